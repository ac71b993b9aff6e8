"""The composition root: :func:`build` turns a checked config into a ready trainer.

Everything a config names is built here, once, in dependency order — the pipeline (what it needs
decides the rest), the tokenizer, the task, the policy on ``run.device``, the engine, a reference
when the pipeline needs ``ref_logprobs``, a critic when it needs ``values``, the parallelism, the
environment and rewards; then the trainer's collaborators (learner, publisher, checkpointer, KL
controller, collector) — and handed to the trainer, which builds nothing itself.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hyperrl.agents.mcp import Toolbox
from hyperrl.algorithms import term
from hyperrl.config import ConfigError, TrainConfig, validate_config
from hyperrl.data.tasks import make_task
from hyperrl.device import pick_device, torch_dtype
from hyperrl.distributed import ParallelDims, make_parallel
from hyperrl.distributed.parallelize import fully_shard_model, tensor_parallel_model, tp_partial_params
from hyperrl.envs import ENVIRONMENTS
from hyperrl.loop.checkpointer import Checkpointer
from hyperrl.loop.collect import SyncCollector
from hyperrl.loop.collect_async import AsyncCollector
from hyperrl.loop.evaluate import Evaluator
from hyperrl.loop.generation import Generator, stop_ids_of
from hyperrl.loop.learner import Learner, Optimized
from hyperrl.loop.pipeline import build_pipeline
from hyperrl.loop.preference import PairCollector, PairEvaluator
from hyperrl.loop.prepare import Forwards, Preparer
from hyperrl.loop.publish import PolicyPublisher
from hyperrl.loop.scoring import Scorer
from hyperrl.loop.trainer import Trainer
from hyperrl.models.head import fp32_lm_head
from hyperrl.models.lora import MergedView, is_lora, trainable_parameters
from hyperrl.models.moe import is_moe
from hyperrl.models.policy import (
    build_critic,
    build_image_processor,
    build_policy,
    build_reference,
    build_teachers,
    build_tokenizer,
)
from hyperrl.rewards import build_rewards
from hyperrl.rollout.engines import ENGINES, EngineContext
from hyperrl.rollout.publisher import Publisher
from hyperrl.rollout.workers import EXECUTORS, REMOTE_EXECUTORS

__all__ = ["build", "build_trainer", "build_models"]


def _with_async(cfg: TrainConfig, overrides: dict) -> TrainConfig:
    """``cfg`` with keys of its ``async`` section replaced (``build(cfg, max_staleness=1)``), validated
    and checked again as the config loader does."""
    if not overrides:
        return cfg
    d = cfg.to_dict()
    d["async"] = {**d["async"], **overrides}
    return validate_config(d)


def build_models(cfg: TrainConfig, pipeline, tok, device, parallel, dims):
    """The policy (on ``device``, parallelised over ``dims``), the engine, the reference and the critic."""
    m, dtype = cfg.model, torch_dtype(cfg.model.dtype)
    policy = build_policy(cfg, tok, lora=False).to(device)
    policy.train()
    if m.lm_head_fp32:  # before the engine and the reference copy it: both sides compute the head in fp32
        fp32_lm_head(policy)
    eng, a = cfg.rollout.engine, getattr(cfg, "async")
    remote = a.max_staleness is not None and a.executor.name in REMOTE_EXECUTORS  # the workers build the engine
    ctx = EngineContext(policy=policy, device=device, dtype=dtype, seed=cfg.run.seed, out_dir=cfg.run.out_dir,
                        tokenizer=tok, lora=m.lora.model_dump() if m.lora is not None else None, remote=remote)
    engine = ENGINES.build(eng.name, **eng.args)(ctx)  # from the base weights (= the LoRA model at init: B = 0)
    policy, reference = build_reference(cfg, policy, "ref_logprobs" in pipeline.needs)
    critic = build_critic(cfg, tok, policy.config.hidden_size).to(device) if "values" in pipeline.needs else None
    if m.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dims.ep > 1:
        policy = expert_parallel_model(cfg, policy, dims, device, dtype, parallel, reference, critic)
    elif dims.tp > 1:
        policy = tensor_parallel_model(policy, dims, device, dtype)
        parallel.sum_over_tp(tp_partial_params(policy))
    elif dims.world > 1:
        if dims.cp > 1:  # before sharding: the checks read the plain model
            context_parallel_model(policy, reference, dims, parallel)
        if m.lora is None:
            policy = fully_shard_model(policy, decoder_layers(policy), dims, device, dtype)
        else:  # the frozen base replicated, the adapters' gradients all-reduced (parallel.sync_grads)
            parallel.replicate(policy)
        if critic is not None:
            critic = fully_shard_model(critic, critic.backbone.layers, dims, device, dtype)
    if m.compile:  # last: the engine's and the reference's copies must not share the compiled forward
        policy.compile(backend=m.compile, dynamic=True)
    return policy, engine, reference, critic


def decoder_layers(policy):
    """The policy's decoder layers (FSDP2's units): ``model.layers``, a vision-language model's
    ``model.language_model.layers`` (its vision tower stays in the root unit)."""
    inner = policy.model
    return getattr(inner, "language_model", inner).layers


def expert_parallel_model(cfg: TrainConfig, policy, dims, device, dtype, parallel, reference, critic):
    """``run.ep > 1``: each sparse layer's experts split over groups of ``ep`` ranks (DTensors on the
    ``("replica", "ep")`` mesh; tokens dispatched by all-to-all), FSDP2 over every rank for the rest,
    the experts' gradients summed over their replicas by the data-parallel strategy. With ``run.tp > 1``
    an ``ep`` group is ``ep`` data-parallel ranks at one TP coordinate (the ``("replica", "ep", "tp")``
    mesh); attention is tensor-parallel by the family's plan, FSDP2 over ``dp`` for the rest. A reference model (KL)
    stays a whole frozen copy on every rank (built before the split: every expert, no all-to-all), scoring
    this rank's rows locally."""
    from hyperrl.distributed.expert_parallel import expert_params, shard_experts
    from hyperrl.routing import is_moe

    why = [w for w, bad in (("the policy is dense (model.experts=0)", not is_moe(policy)),
                            ("model.lora", cfg.model.lora is not None), ("a critic", critic is not None),
                            ("model.gradient_checkpointing", cfg.model.gradient_checkpointing)) if bad]
    if why:
        raise ConfigError(f"run.ep={dims.ep}: expert parallelism here trains an MoE policy (and a reference) — not "
                          f"with {', '.join(why)}; set run.ep=1")
    mesh = dims.expert_mesh(device.type)
    experts = shard_experts(policy, mesh.get_group("ep"), mesh.get_local_rank("ep"), dims.ep, mesh)
    params = expert_params(experts)
    if dims.tp > 1:
        policy = tensor_parallel_model(policy, dims, device, dtype, ignored=params)
        parallel.sum_over_tp(tp_partial_params(policy))
    else:
        policy = fully_shard_model(policy, policy.model.layers, dims, device, dtype, ignored=params)
    parallel.experts_over(params, mesh.get_group("replica"))
    return policy


def context_parallel_model(policy, reference, dims, parallel) -> None:
    """``run.cp > 1``: the policy's (and a reference's) attention runs as Ulysses attention over this rank's
    context-parallel group (each rank a slice of every sequence; the engine's copy is untouched). Refused
    for a family whose attention does not go through transformers' attention interface (no CP plan) and
    for heads that ``cp`` does not divide."""
    from hyperrl.distributed.context_parallel import context_parallel
    from hyperrl.routing import is_moe

    name = type(policy).__name__
    if not getattr(policy, "_supports_attention_backend", False):
        raise ConfigError(f"run.cp={dims.cp}: {name} has no context-parallel plan (its attention does not use "
                          "transformers' attention interface, which Ulysses attention plugs into); set run.cp=1")
    if is_moe(policy):
        raise ConfigError(f"run.cp={dims.cp}: {name} is a mixture of experts — context parallelism trains a dense "
                          "policy yet; set run.cp=1")
    heads = policy.config.num_attention_heads
    if heads % dims.cp:
        raise ConfigError(f"run.cp={dims.cp} does not divide the attention heads ({heads}) of {name}: Ulysses "
                          "attention splits the heads over the cp ranks")
    for model in (policy, reference):
        if model is not None:
            context_parallel(model, parallel.cp_group)


def _check_context(cfg: TrainConfig, task, policy) -> None:
    """The longest prompt (a files task encodes every prompt once) plus the response budget — or a
    multi-turn episode's token budget — fits the model's context (``max_position_embeddings``;
    vLLM refuses longer sequences and a RoPE model past it generates from positions it never saw)."""
    ctx = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    if not ctx:
        return
    r = cfg.rollout
    pairs = getattr(task, "longest_sequence", 0)  # preference pairs: prompt + the longer completion
    if pairs > ctx:
        raise ConfigError(f"a preference pair of {pairs} tokens (prompt + completion) exceeds the model's context "
                          f"(max_position_embeddings={ctx}); bound prompts with data.max_prompt_length, or shorten "
                          "the completions")
    if cfg.env is not None:
        if r.max_episode_tokens > ctx:
            raise ConfigError(f"rollout.max_episode_tokens={r.max_episode_tokens} exceeds the model's context "
                              f"(max_position_embeddings={ctx}); set rollout.max_episode_tokens ≤ {ctx}")
        return
    longest = getattr(task, "longest_prompt", 0)
    if longest + r.max_new_tokens > ctx:
        raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens} + the longest prompt ({longest} tokens) = "
                          f"{longest + r.max_new_tokens} exceeds the model's context (max_position_embeddings={ctx}); "
                          f"set rollout.max_new_tokens ≤ {ctx - longest}, or bound prompts with data.max_prompt_length")


def build(cfg: TrainConfig, hooks=(), *, trainer: type | None = None, pipeline=None, **async_overrides) -> Trainer:
    """Everything a config names, built once it has been checked (:func:`hyperrl.load_config`)
    — see the module doc — and the :class:`~hyperrl.loop.trainer.Trainer` that runs it (with the asynchronous
    collector when ``async.max_staleness`` is set, the pair collector under ``algo.preference``).
    Every module, buffer and optimizer state lives on ``run.device``: fp32 master weights
    (``model.param_dtype``), compute in ``model.dtype``. ``trainer``: another trainer class over
    the same pieces; ``pipeline``: a :class:`~hyperrl.loop.pipeline.Pipeline` of your own in place of
    the config's (e.g. ``dataclasses.replace(p, transform=T.chain(p.transform, my_stage))``; what it
    ``needs`` decides what is built); ``async_overrides``: keys of the ``async`` section
    (``max_staleness=1``), checked as at load."""
    cfg = _with_async(cfg, async_overrides)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    pipeline = pipeline if pipeline is not None else build_pipeline(cfg.algo)
    device = pick_device(cfg.run.device)
    tok = build_tokenizer(cfg)
    task = make_task(cfg.task, tok, cfg.run.seed, build_image_processor(cfg))
    need = getattr(task, "response_tokens", 0)
    if cfg.rollout.max_new_tokens < need:  # multi-turn too: the answer turn needs the room (known once built)
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: task {cfg.task.name!r} has answers "
                         f"of up to {need - 1} tokens + EOS; set rollout.max_new_tokens ≥ {need}")
    dims = ParallelDims.from_env(cfg.run.tp, cfg.run.ep, cfg.run.cp)
    parallel = make_parallel(dims)
    policy, engine, reference, critic = build_models(cfg, pipeline, tok, device, parallel, dims)
    _check_context(cfg, task, policy)
    make_env = ENVIRONMENTS.build(cfg.env.name, **cfg.env.args) if cfg.env is not None else None
    rewards = build_rewards(cfg.rewards) if cfg.rewards else None
    toolbox = Toolbox([t.model_dump() for t in cfg.tools]) if cfg.tools else None  # MCP servers start here
    env_fn = ENVIRONMENTS.factory(cfg.env.name).fn if cfg.env is not None else None
    a = getattr(cfg, "async")
    asynchronous = a.max_staleness is not None
    trainer = trainer or Trainer
    if is_moe(policy):  # the router's load-balancing term, from the update's own forward
        pipeline = pipeline.with_terms(term("router", coef=cfg.model.router_aux_loss_coef))
    workers = None
    try:
        if asynchronous:
            workers = EXECUTORS.build(a.executor.name, **a.executor.args)(engine)
            engine = workers.engine  # the learner publishes to (and evaluates with) the executor's engine
        if getattr(env_fn, "takes_tools", False):
            make_env = functools.partial(make_env, toolbox.tools if toolbox is not None else None)
        if getattr(env_fn, "owns_loop", False):
            make_env = _bind_agent(cfg, make_env(), engine, tok, policy, rewards is not None, toolbox)
        return _assemble(cfg, trainer, pipeline, tok, task, policy, engine, reference, critic, parallel, make_env,
                         rewards, workers, hooks, toolbox)
    except BaseException:
        if workers is not None:
            workers.close()
        if getattr(make_env, "owns_loop", False) and not isinstance(make_env, type):  # a bound agent's gateway
            make_env.close()
        if toolbox is not None:
            toolbox.close()
        raise


def _bind_agent(cfg: TrainConfig, agent, engine, tok, policy, has_rewards: bool, toolbox):
    """The agent environment serving ``engine`` through its gateway (the context: the model's)."""
    r = cfg.rollout
    ctx = getattr(getattr(policy, "config", None), "max_position_embeddings", None) or r.max_episode_tokens
    sampling = Generator(engine, None, tok, r, seed=cfg.run.seed, stop_ids=stop_ids_of(policy)).sampling(0)
    return agent.bind(engine, tok, sampling, max_model_len=ctx, max_episode_tokens=r.max_episode_tokens,
                      max_concurrent=r.max_concurrent_episodes, has_rewards=has_rewards, toolbox=toolbox,
                      tool_sources=[t.model_dump() for t in cfg.tools])


def _assemble(cfg, trainer, pipeline, tok, task, policy, engine, reference, critic, parallel, make_env, rewards,
              workers, hooks, toolbox=None) -> Trainer:
    """The trainer's collaborators — learner, publisher, checkpointer, KL controller, generator,
    scorer, evaluator, collector — and the trainer over them."""
    o, a, r = cfg.optim, cfg.algo, cfg.rollout
    parts = {"policy": Optimized(policy, torch.optim.AdamW(trainable_parameters(policy), lr=o.lr, betas=o.betas,
                                                           weight_decay=o.weight_decay), o.lr)}
    if critic is not None:
        parts["critic"] = Optimized(critic, torch.optim.AdamW(critic.parameters(), lr=a.critic.lr), a.critic.lr)
    learner = Learner(parts, grad_clip=o.grad_clip, schedule=o.schedule, warmup=o.warmup_steps,
                      min_lr_ratio=o.min_lr_ratio, total_steps=cfg.run.steps * o.mini_batches * a.ppo_epochs,
                      parallel=parallel)
    lora = is_lora(policy)
    published = MergedView(policy) if lora else policy
    publisher = PolicyPublisher(engine, policy, published,
                                Publisher.for_engine(published, engine, rank=parallel.rank, world=parallel.world),
                                adapters_only=lora and engine.capabilities.lora_adapters,
                                delta=r.delta_encoding if r.delta_publication else False)
    checkpointer = Checkpointer(Path(cfg.run.out_dir) / "checkpoints", parallel, keep_last_k=cfg.run.keep_last_k)
    stop_ids = stop_ids_of(policy)
    agent = make_env if getattr(make_env, "owns_loop", False) else None
    generator = Generator(engine, task, tok, r, seed=cfg.run.seed, stop_ids=stop_ids,
                          make_env=None if agent is not None else make_env, agent=agent, toolbox=toolbox)
    scorer = Scorer(tok, task, rewards=rewards, multi_turn=make_env is not None, stop_ids=stop_ids,
                    token_rewards="token_rewards" in pipeline.needs)
    evaluator = Evaluator(generator, scorer, task, parallel, eval_n=cfg.run.eval_n, eval_prompts=cfg.run.eval_prompts)
    forwards = Forwards(cfg, parallel, next(policy.parameters()).device)
    try:
        teachers = build_teachers(cfg, tok, next(policy.parameters()).device)
    except ValueError as e:  # a teacher whose tokenizer is not the student's
        raise ConfigError(str(e)) from None
    preparer = Preparer(forwards, policy, pipeline, cfg, reference=reference, critic=critic, teachers=teachers,
                        generator=generator, scorer=scorer)
    if a.preference is not None:  # pairs from the preference task, not rollouts
        collector = PairCollector(task, parallel, r, o.micro_batch_tokens, tok.pad_token_id or 0)
        evaluator = PairEvaluator(collector, preparer, task, parallel, pipeline, eval_prompts=cfg.run.eval_prompts)
    elif workers is None:
        collector = SyncCollector(generator, scorer, pipeline, task, parallel, r)
    else:
        s = getattr(cfg, "async")
        collector = AsyncCollector(workers, task, generator, scorer, pipeline, r, eta=s.max_staleness,
                                   max_concurrent=s.max_concurrent, timeout_s=s.timeout_s, schedule=s.schedule,
                                   replay=s.replay, kv_cache=s.kv_cache, seed=cfg.run.seed, threads=cfg.run.threads,
                                   log=Path(cfg.run.out_dir) / "async_events.jsonl",
                                   fresh=checkpointer.latest() is None)
    return trainer(cfg, policy=policy, engine=engine, tokenizer=tok, task=task, pipeline=pipeline,
                   collector=collector, generator=generator, scorer=scorer, evaluator=evaluator, forwards=forwards,
                   preparer=preparer, learner=learner,
                   publisher=publisher, checkpointer=checkpointer,
                   kl_controller=pipeline.kl_controller(pipeline.kl_coef), parallel=parallel, reference=reference,
                   critic=critic, hooks=hooks)


build_trainer = build  # the name earlier releases used
