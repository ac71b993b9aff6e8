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
from hyperrl.config.built import check_built, check_teachers
from hyperrl.data.tasks import TASKS, make_task
from hyperrl.device import pick_device, torch_dtype
from hyperrl.distributed import ParallelDims, make_parallel
from hyperrl.distributed.offload import HostAdamW
from hyperrl.distributed.parallelize import Models, parallelize_models, parallelize_teachers
from hyperrl.envs import ENVIRONMENTS, EnvCapabilities
from hyperrl.loop.checkpointer import Checkpointer
from hyperrl.loop.collect import SyncCollector
from hyperrl.loop.collect_async import AsyncCollector
from hyperrl.loop.drivers import make_driver
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
from hyperrl.rollout.attention import use_gqa_sdpa
from hyperrl.rollout.engines import EngineContext, build_engine
from hyperrl.rollout.publisher import Publisher
from hyperrl.rollout.workers import EXECUTORS

__all__ = ["build", "build_trainer", "build_models"]


def _with_async(cfg: TrainConfig, overrides: dict) -> TrainConfig:
    """``cfg`` with keys of its ``async`` section replaced (``build(cfg, max_staleness=1)``), validated
    and checked again as the config loader does."""
    if not overrides:
        return cfg
    d = cfg.to_dict()
    d["async"] = {**d["async"], **overrides}
    return validate_config(d)


def build_models(cfg: TrainConfig, pipeline, tok, task, device, parallel, dims) -> tuple:
    """The policy (on ``device``, parallelised over ``dims`` by :func:`~hyperrl.distributed.parallelize_models`),
    the engine, the reference and the critic — the built pieces checked first (:func:`check_built`)."""
    m, dtype = cfg.model, torch_dtype(cfg.model.dtype)
    policy = build_policy(cfg, tok, lora=False).to(device)
    # grouped K/V reach torch's attention as they are (the engine's, the reference's and the critic's too): the
    # same values and gradients bit for bit as transformers' sdpa without repeating K/V per query head — at the
    # default job's continuation (512 rows × 2 queries × 9 keys) forward + backward 4.3 ms repeated, 2.4 grouped
    use_gqa_sdpa(policy)
    policy.train()
    check_built(cfg, task=task, policy=policy, dims=dims, critic="values" in pipeline.needs)
    if m.lm_head_fp32:  # before the engine and the reference copy it: both sides compute the head in fp32
        fp32_lm_head(policy)
    eng, a = cfg.rollout.engine, getattr(cfg, "async")
    remote = a.max_staleness is not None and \
        EXECUTORS.factory(a.executor.name).capabilities_for(a.executor.args).remote  # the workers build the engine
    ctx = EngineContext(policy=policy, device=device, dtype=dtype, seed=cfg.run.seed, out_dir=cfg.run.out_dir,
                        tokenizer=tok, lora=m.lora.model_dump() if m.lora is not None else None, remote=remote)
    engine = build_engine(eng.name, eng.args, ctx)  # from the base weights (= the LoRA model at init: B = 0)
    policy, reference = build_reference(cfg, policy, "ref_logprobs" in pipeline.needs)
    critic = build_critic(cfg, tok, policy.config.hidden_size).to(device) if "values" in pipeline.needs else None
    if critic is not None:
        use_gqa_sdpa(critic)
    if m.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    models = parallelize_models(Models(policy, reference, critic), dims, parallel, device=device, dtype=dtype,
                                lora=m.lora is not None)
    if m.compile:  # last: the engine's and the reference's copies must not share the compiled forward
        models.policy.compile(backend=m.compile, dynamic=True)
    return models.policy, engine, reference, models.critic


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
    images = build_image_processor(cfg)  # a vision-language model's (None for a text model)
    task = make_task(cfg.task, tok, cfg.run.seed, images)
    vision = images is not None and TASKS.factory(cfg.task.name).capabilities_for().takes_images
    dims = ParallelDims.from_config(cfg.run)
    parallel = make_parallel(dims)
    policy, engine, reference, critic = build_models(cfg, pipeline, tok, task, device, parallel, dims)
    env = ENVIRONMENTS.build(cfg.env.name, **cfg.env.args) if cfg.env is not None else None
    env_caps = ENVIRONMENTS.factory(cfg.env.name).capabilities_for() if cfg.env is not None else EnvCapabilities()
    rewards = build_rewards(cfg.rewards) if cfg.rewards else None
    toolbox = Toolbox([t.model_dump() for t in cfg.tools]) if cfg.tools else None  # MCP servers start here
    a = getattr(cfg, "async")
    asynchronous = a.max_staleness is not None
    trainer = trainer or Trainer
    if is_moe(policy):  # the router's load-balancing term, from the update's own forward
        pipeline = pipeline.with_terms(term("router", coef=cfg.model.router_aux_loss_coef))
    workers = driver = None
    try:
        if asynchronous:
            workers = EXECUTORS.build(a.executor.name, **a.executor.args)(engine)
            engine = workers.engine  # the learner publishes to (and evaluates with) the executor's engine
        if env_caps.takes_tools:
            env = functools.partial(env, toolbox.tools if toolbox is not None else None)
        if env_caps.owns_loop:  # an agent: one environment serving the engine through its gateway
            env = _bind_agent(cfg, env(), engine, tok, policy, rewards is not None, toolbox)
        driver = make_driver(env, env_caps)  # the kind of rollout, chosen once
        return _assemble(cfg, trainer, pipeline, tok, task, vision, policy, engine, reference, critic, parallel,
                         driver, rewards, workers, hooks, toolbox)
    except BaseException:
        if workers is not None:
            workers.close()
        if driver is not None:  # a bound agent's gateway
            driver.close()
        if toolbox is not None:
            toolbox.close()
        if rewards is not None:  # their worker processes
            rewards.close()
        raise


def _bind_agent(cfg: TrainConfig, agent, engine, tok, policy, has_rewards: bool, toolbox):
    """The agent environment serving ``engine`` through its gateway (the context: the model's)."""
    r = cfg.rollout
    ctx = getattr(getattr(policy, "config", None), "max_position_embeddings", None) or r.max_episode_tokens
    sampling = Generator(engine, None, tok, r, seed=cfg.run.seed, stop_ids=stop_ids_of(policy)).sampling(0)
    return agent.bind(engine, tok, sampling, max_model_len=ctx, max_episode_tokens=r.max_episode_tokens,
                      max_concurrent=r.max_concurrent_episodes, has_rewards=has_rewards, toolbox=toolbox,
                      tool_sources=[t.model_dump() for t in cfg.tools])


def _assemble(cfg, trainer, pipeline, tok, task, vision, policy, engine, reference, critic, parallel, driver,
              rewards, workers, hooks, toolbox=None) -> Trainer:
    """The trainer's collaborators — learner, publisher, checkpointer, KL controller, generator,
    scorer, evaluator, collector — and the trainer over them."""
    o, a, r = cfg.optim, cfg.algo, cfg.rollout
    adamw = HostAdamW if o.offload == "cpu" else torch.optim.AdamW  # optim.offload: the state in host memory
    parts = {"policy": Optimized(policy, adamw(trainable_parameters(policy), lr=o.lr, betas=o.betas,
                                               weight_decay=o.weight_decay), o.lr)}
    if critic is not None:
        parts["critic"] = Optimized(critic, adamw(critic.parameters(), lr=a.critic.lr), a.critic.lr)
    learner = Learner(parts, grad_clip=o.grad_clip, schedule=o.schedule, warmup=o.warmup_steps,
                      min_lr_ratio=o.min_lr_ratio, total_steps=cfg.run.steps * o.mini_batches * a.ppo_epochs,
                      parallel=parallel)
    lora = is_lora(policy)
    published = MergedView(policy) if lora else policy
    publisher = PolicyPublisher(engine, policy, published,
                                Publisher.for_engine(published, engine, rank=parallel.rank, world=parallel.world,
                                                     parallel=parallel, fan_out=r.fan_out),
                                adapters_only=lora and engine.capabilities.lora_adapters,
                                delta=r.delta_encoding if r.delta_publication else False)
    checkpointer = Checkpointer(Path(cfg.run.out_dir) / "checkpoints", parallel, keep_last_k=cfg.run.keep_last_k)
    stop_ids = stop_ids_of(policy)
    generator = Generator(engine, task, tok, r, seed=cfg.run.seed, stop_ids=stop_ids, driver=driver, toolbox=toolbox,
                          vision=vision)
    scorer = Scorer(tok, task, rewards=rewards, multi_turn=driver.multi_turn,
                    stop_ids=stop_ids, token_rewards="token_rewards" in pipeline.needs)
    evaluator = Evaluator(generator, scorer, task, parallel, eval_n=cfg.run.eval_n, eval_prompts=cfg.run.eval_prompts,
                          greedy=cfg.run.eval_greedy)
    forwards = Forwards(cfg, parallel, next(policy.parameters()).device)
    try:
        teachers = build_teachers(cfg, tok, next(policy.parameters()).device)
    except ValueError as e:  # a teacher whose tokenizer is not the student's
        raise ConfigError(str(e)) from None
    dims = ParallelDims.from_config(cfg.run)
    check_teachers(teachers, dims)
    teachers = parallelize_teachers(teachers, dims, parallel)  # run.cp: sliced as the policy is
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
