"""Frozen run configuration at the edge, checked completely when it is loaded.

Layers, later over earlier: the defaults below ← the recipe named by ``algo.recipe``
(:mod:`hyperrl.recipes`) ← a YAML file ← ``--a.b=value`` overrides (values parsed as YAML).
Types, unknown keys, dict and list values are validated by pydantic (frozen models,
``extra="forbid"``). A **variant** section names a registered factory and its arguments —
``objective: {name: gspo, clip_low: 3.0e-4}`` or just ``objective: gspo`` — and is checked
against that factory's signature at load time: the name must be registered, every argument one
the factory takes, of its type; arguments not given take the **factory's** defaults (the only
defaults). Merging a variant keeps the arguments of the layer below only while the name stays
the same, so ``--algo.objective=gspo`` gets GSPO's clips, never PPO's. Nothing is built here:
a config error names the dotted key and the fix before any model, engine or process group exists.

Pure transforms never see these objects; the trainer reads the scalars and passes them on.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

__all__ = ["Variant", "RewardSpec", "DataConfig", "LoraConfig", "ModelConfig", "RolloutConfig", "KLConfig",
           "CriticConfig", "AlgoConfig", "OptimConfig", "RunConfig", "TrainConfig", "load_config", "ConfigError",
           "describe"]


class ConfigError(ValueError):
    """A bad config key or value; the message names the dotted key and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True)


class Variant(_Frozen):
    """A registered factory by name and its hyperparameters (``{name: x, **args}`` or ``"x"``)."""

    name: str
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, v):
        if isinstance(v, str):
            return {"name": v}
        if isinstance(v, dict) and "args" not in v:
            if "name" not in v:
                raise ValueError(f"a variant needs a 'name' (got keys {sorted(v)})")
            return {"name": v["name"], "args": {k: x for k, x in v.items() if k != "name"}}
        return v

    def spec(self) -> dict:
        return {"name": self.name, **self.args}


DType = Literal["float32", "bfloat16", "float16"]


class LoraConfig(_Frozen):
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: int = Field(16, ge=1, description="LoRA alpha (scale alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (training forwards only)")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"],
                                      description="module names that get adapters")
    train_modules: list[str] = Field(default_factory=list, description="module paths trained fully besides the "
                                     "adapters (e.g. model.norm, model.embed_tokens); saved in checkpoints too")


class ModelConfig(_Frozen):
    hidden: int = Field(128, description="tiny Qwen3: hidden size (random init; ignored with checkpoint)")
    layers: int = Field(2, description="tiny Qwen3: decoder layers")
    heads: int = Field(4, description="tiny Qwen3: attention heads")
    kv_heads: int = Field(2, description="tiny Qwen3: key/value heads")
    head_dim: int = Field(32, description="tiny Qwen3: head dimension")
    intermediate: int = Field(256, description="tiny Qwen3: MLP width")
    checkpoint: str | None = Field(None, description="a local HF checkpoint directory instead of a random init")
    tokenizer: str | None = Field(None, description="tokenizer directory (AutoTokenizer); default: the checkpoint's "
                                  "own, or the embedded character tokenizer without a checkpoint")
    dtype: DType = Field("float32", description="compute dtype: activations (autocast / FSDP2 param_dtype), the "
                         "rollout engine's and the reference's weights; log-probs and losses stay fp32")
    param_dtype: DType = Field("float32", description="trainable parameters and optimizer state (fp32 master "
                               "weights by default; bfloat16 halves their memory)")
    gradient_checkpointing: bool = Field(False, description="recompute decoder layers in backward (implies "
                                         "optim.shared_prefix=false: checkpointed layers drop the KV cache)")
    compile: str = Field("", description="torch.compile backend for the trainer's policy forward ('' = off; "
                         "'inductor', or 'eager' / 'aot_eager' to check tracing)")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters (PEFT) instead of every weight: "
                                    "{r, alpha, dropout, target_modules}; the reference is the base (no copy)")


class RolloutConfig(_Frozen):
    engine: Variant = Field(Variant(name="transformers"), description="rollout engine (hyperrl.rollout.ENGINES)")
    prompts_per_step: int = Field(32, ge=1, description="prompts (groups) per step, over all ranks")
    n: int = Field(16, ge=1, description="samples per prompt (the group size)")
    max_new_tokens: int = Field(3, ge=1, description="response budget per turn (the default task's answers: 2 "
                                "digits + EOS)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also divides the trainer's logits)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1 = off)")
    top_k: int = Field(0, ge=0, description="top-k sampling (0 = off)")
    max_turns: int = Field(3, ge=1, description="multi-turn: turns per episode (with env)")
    max_obs_tokens: int = Field(64, ge=1, description="multi-turn: tokens per observation (text is cut to it; a "
                                "chat observation that does not fit ends the episode)")
    max_episode_tokens: int = Field(256, ge=2, description="multi-turn: tokens per episode, prompt included (the "
                                    "episode stops when they are spent)")
    max_generation_batches: int = Field(4, ge=1, description="with algo.filter: generation rounds per step to "
                                        "refill the batch with informative groups (verl max_num_gen_batches)")


class KLConfig(_Frozen):
    coef: float = Field(0.0, ge=0, description="β of the KL loss term (> 0 builds a reference model)")
    estimator: str = Field("k3", description="KL estimator (hyperrl.transforms.KL_ESTIMATORS; '+' suffix: "
                           "straight-through)")
    clamp_input: float | None = Field(None, description="clamp lp − ref to ±this (verl low_var_kl: 20)")
    clamp_output: float | None = Field(None, description="clamp the estimate to ±this (verl low_var_kl: 10)")
    controller: Variant = Field(Variant(name="fixed"), description="β controller (KL_CONTROLLERS: fixed | adaptive)")


class CriticConfig(_Frozen):
    lr: float = Field(0.003, gt=0, description="critic learning rate (a critic is built when a factory needs "
                      "'values')")
    value_clip: float | None = Field(0.2, description="value clip around the rollout-time values (null = off)")
    value_coef: float = Field(1.0, ge=0, description="weight of loss_value")


class AlgoConfig(_Frozen):
    recipe: str = Field("grpo_clip_higher", description="named chain (hyperrl.recipes.RECIPES); the keys below "
                        "override its parts")
    advantage: Variant = Field(Variant(name="grpo"), description="advantage estimator (transforms.ADVANTAGES)")
    objective: Variant = Field(Variant(name="ppo_clip"), description="policy objective (transforms.OBJECTIVES)")
    agg: Variant = Field(Variant(name="token-mean"), description="loss aggregation (transforms.AGGREGATIONS)")
    kl: KLConfig = Field(default_factory=KLConfig)
    correction: Variant | None = Field(None, description="rollout/trainer mismatch correction (transforms."
                                       "CORRECTIONS: tis | mis | rejection)")
    shaping: list[Variant] = Field(default_factory=list, description="reward shaping stages, in order "
                                   "(transforms.SHAPING: overlong | clip)")
    filter: Variant | None = Field(None, description="group filter with refill (transforms.FILTERS: "
                                   "dynamic_sampling)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight (loss_entropy = −c·agg(H))")
    ppo_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    gate_threshold: float | None = Field(None, description="bit-exact gate: refuse the update above this "
                                         "trainer–rollout log-prob gap")
    proximal: Literal["recompute", "interpolate"] = Field("recompute", description="the proximal policy π_prox "
                                                          "(old_logprobs: PPO's anchor, decoupled PPO's "
                                                          "π_prox/π_behav): recompute = a forward of the learner's "
                                                          "version V; interpolate = A-3PO, log π_behav + α(log π_θ "
                                                          "− log π_behav), α = (V − v_t)/(V + 1 − v_t), no forward")
    critic: CriticConfig = Field(default_factory=CriticConfig)


class OptimConfig(_Frozen):
    lr: float = Field(1e-3, gt=0, description="policy learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per rollout batch")
    micro_batch_tokens: int = Field(8192, ge=0, description="gradient-accumulation budget per micro-batch, in "
                                    "padded tokens (rows x longest row): rows grouped by length, a prompt's samples "
                                    "together, each micro-batch cut to its longest row (0 = whole mini-batch)")
    shared_prefix: bool = Field(True, description="run each distinct prompt once per forward when cheaper")
    pack_tokens: int = Field(0, ge=0, description="padding-free trainer forwards: each micro-batch's rows packed "
                             "into sequences of at most this many tokens (position ids restart per row, no padding "
                             "computed; replaces the shared-prefix forward; one process only); 0 = off")
    schedule: str = Field("constant", description="lr schedule (hyperrl.schedules.SCHEDULES)")
    warmup_steps: int = Field(0, ge=0, description="linear warmup, in optimizer steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="where linear/cosine end, as a fraction of lr")


class DataConfig(_Frozen):
    train_files: list[str] = Field(default_factory=list, description="parquet / JSONL / JSON training prompts "
                                   "(verl columns); set = task 'files' (do not also set task)")
    val_files: list[str] = Field(default_factory=list, description="validation prompts (evaluation runs on these, "
                                 "never on training rows)")
    prompt_key: str = Field("prompt", description="the prompt column (a string or chat messages)")
    max_prompt_length: int = Field(0, ge=0, description="prompt token limit (0 = none)")
    overlong_prompts: Literal["error", "filter", "truncate"] = Field("error", description="a prompt over "
                                                                     "max_prompt_length: error | filter | truncate")
    rewards: list[str] = Field(default_factory=lambda: ["gsm8k_exact"], description="the files task's registered "
                               "rewards (the top-level rewards: list overrides them)")


class RunConfig(_Frozen):
    steps: int = Field(4000, ge=0, description="training steps")
    seed: int = Field(0, description="seed of data, sampling, init and update order")
    eval_every: int = Field(100, ge=0, description="held-out evaluation every k steps (0 = off)")
    eval_prompts: int = Field(256, ge=1, description="held-out prompts per evaluation")
    eval_n: int = Field(1, ge=1, description="samples per held-out prompt: eval_reward_mean = mean@k, "
                        "eval_pass_at_k = mean over prompts of the best sample's reward")
    log_completions: int = Field(0, ge=0, description="write k rows per step (prompt, completion, rewards, "
                                 "advantage) to completions.jsonl (and TensorBoard / W&B)")
    keep_last_k: int = Field(0, ge=0, description="keep only the newest k checkpoints (0 = all)")
    export: bool = Field(True, description="at the end, save_pretrained model + tokenizer to out_dir/hf "
                         "(loads with transformers / vLLM); also `hyperrl export CKPT DIR`")
    ckpt_every: int = Field(0, ge=0, description="checkpoint every k steps (0 = only at the end)")
    out_dir: str = Field("runs/default", description="metrics.jsonl, reward_curve.png, checkpoints/")
    device: str = Field("cpu", description="cpu | cuda | npu")
    tp: int = Field(1, ge=1, description="tensor parallelism of the trainer's policy under torchrun: groups of tp "
                    "consecutive ranks split every decoder layer (Megatron's split, hyperrl.parallelize), FSDP2 "
                    "over the world / tp data-parallel groups; 1 = FSDP2 over every rank")
    threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch default)")
    wandb_project: str = Field("", description="log to Weights & Biases under this project (pip install wandb)")


class RewardSpec(_Frozen):
    """One reward (see :mod:`hyperrl.rewards`)."""

    fn: str = Field(description="'path/to/file.py:function' or a registered reward (REWARDS, REWARD_FACTORIES)")
    weight: float = Field(1.0, description="its weight in the total reward Σ w·r (and GDPO's component weight)")
    style: Literal["trl", "verl", "hyperrl"] | None = Field(None, description="calling convention (required for "
                                                           "a file's function)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="extra keyword arguments (a factory's "
                                   "hyperparameters for registered factories)")
    name: str | None = Field(None, description="metric name (default: the function's)")
    data_source: str | list[str] | None = Field(None, description="score only samples of these data_source "
                                                "values (the rest: not applicable)")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v):
        return {"fn": v} if isinstance(v, str) else v


class AsyncConfig(_Frozen):
    max_staleness: int | None = Field(None, ge=0, description="η: asynchronous RL (AsyncTrainer) — a trained token "
                                      "lags the learner by at most η versions; null = the synchronous SyncTrainer "
                                      "(docs/async.md)")
    max_concurrent: int = Field(0, ge=0, description="prompt groups in flight at most (0 = (η + 1) · "
                                "rollout.prompts_per_step)")
    timeout_s: float = Field(120.0, gt=0, description="deadline of every wait on the rollout workers (a batch, a "
                             "pause for publication); past it the step fails naming the worker")
    schedule: Literal["free", "gated"] = Field("free", description="free: workers run ahead within η, publications "
                                               "interrupt and resume requests; gated: batch k is generated whole at "
                                               "version max(0, k − η) — the same run every time (docs/async.md)")
    kv_cache: Literal["reprefill", "keep"] = Field("reprefill", description="what a publication does to a request "
                                                   "being generated: reprefill — interrupt it and continue from its "
                                                   "tokens under the new weights (its cache recomputed); keep — park "
                                                   "it and continue over its old KV cache (in-flight update; "
                                                   "kv_version records it per token; thread executor)")
    replay: str | None = Field(None, description="the event log (out_dir/async_events.jsonl) of a free-running run "
                               "to replay bit for bit: the same worker calls, interrupted at the same decode steps, "
                               "and the same batches")
    executor: Variant = Field(Variant(name="thread"), description="where the rollout workers run (hyperrl.rollout."
                              "EXECUTORS: thread | ray)")


class _TrainConfig(_Frozen):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: Variant = Field(Variant(name="arith"), description="task (hyperrl.tasks.TASKS)")
    data: DataConfig = Field(default_factory=DataConfig)
    env: Variant | None = Field(None, description="multi-turn environment (hyperrl.envs.ENVIRONMENTS); null = "
                                "single-turn")
    rewards: list[RewardSpec] = Field(default_factory=list, description="rewards as users write them (TRL / verl "
                                      "/ hyperrl style, weighted, routed by data_source); [] = the task's rewards")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return _plain(self)


# `async` is a Python keyword, so the section is declared by name (read it as getattr(cfg, "async"))
TrainConfig = create_model("TrainConfig", __base__=_TrainConfig, __module__=__name__,
                           **{"async": (AsyncConfig, Field(default_factory=AsyncConfig, description="asynchronous "
                                                           "RL: the staleness bound η and the rollout worker"))})


def _plain(m):
    if isinstance(m, Variant):
        return m.spec()
    if isinstance(m, RewardSpec):
        return {k: getattr(m, k) for k in type(m).model_fields if getattr(m, k) not in (None, {})}
    if isinstance(m, BaseModel):
        return {k: _plain(getattr(m, k)) for k in type(m).model_fields}
    if isinstance(m, list | tuple):
        return [_plain(x) for x in m]
    return m


# ----------------------------------------------------------------------------- layers and merging

def _is_variant(annotation) -> bool:
    """``Variant`` or ``Variant | None`` (not ``list[Variant]``: lists are replaced whole)."""
    return annotation is Variant or (get_origin(annotation) in (Union, UnionType) and Variant in get_args(annotation))


def _as_spec(v):
    return {"name": v} if isinstance(v, str) else v


def _merge(model: type[BaseModel], base: dict, over: dict) -> dict:
    """``over`` on ``base`` (plain dicts): sections recurse, variants keep ``base``'s arguments only
    while the name is unchanged, everything else (lists included) is replaced."""
    out = dict(base)
    for k, v in over.items():
        f = model.model_fields.get(k)
        sub = getattr(f, "annotation", None) if f else None
        if f is not None and isinstance(sub, type) and issubclass(sub, BaseModel) and sub is not Variant \
                and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(sub, out[k], v)
        elif f is not None and _is_variant(sub) and isinstance(_as_spec(v), dict) and \
                isinstance(_as_spec(out.get(k)), dict):
            b, o = _as_spec(out[k]), _as_spec(v)
            out[k] = o if "name" in o and o["name"] != b.get("name") else {**b, **o}
        else:
            out[k] = v
    return out


def _overrides(items: list[str]) -> dict:
    data: dict = {}
    for item in items:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected --section.key=value")
        key, raw = item.split("=", 1)
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            if isinstance(node.get(part), str):  # --algo.objective=gspo --algo.objective.clip_low=…
                node[part] = {"name": node[part]}
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key!r}: {raw!r} is not a YAML value ({e.problem})") from None
    return data


def _dotted(loc) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p in ("args",)))


def _pydantic_error(e: ValidationError) -> ConfigError:
    err = e.errors()[0]
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = _dotted(loc)
    if err["type"] == "extra_forbidden":
        parent = TrainConfig
        for p in loc[:-1]:
            f = parent.model_fields.get(str(p)) if isinstance(parent, type) else None
            parent = f.annotation if f is not None else None
        valid = sorted(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        where = ".".join(map(str, loc[:-1])) or "the top level"
        return ConfigError(f"unknown config key {key!r}; valid keys under {where}: {valid}")
    return ConfigError(f"{key}: {err.get('input')!r} is not valid — {err['msg']}")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults ← recipe ← YAML file ← ``--a.b=value`` overrides; then every variant checked
    against its registry (see the module doc). Raises :class:`ConfigError`."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    over = _overrides(list(overrides))
    for layer in (data, over):
        for section in ("algo", "rollout", "optim", "run", "model"):
            if section in layer and not isinstance(layer[section], dict):
                raise ConfigError(f"{section}: expected a mapping, got {type(layer[section]).__name__}")
    recipe = over.get("algo", {}).get("recipe", data.get("algo", {}).get("recipe", AlgoConfig().recipe))
    from .recipes import recipe_config

    try:
        base = {"algo": recipe_config(recipe)}
    except KeyError as e:
        raise ConfigError(f"algo.recipe: {e.args[0]}") from None
    merged = TrainConfig().to_dict()
    for layer in (base, data, over):
        merged = _merge(TrainConfig, merged, layer)
    merged = _data_task(merged, explicit_task="task" in data or "task" in over)
    try:
        cfg = TrainConfig.model_validate(merged)
    except ValidationError as e:
        raise _pydantic_error(e) from None
    _check_files(cfg)
    _check_rewards(cfg)
    _check_parallel(cfg)
    from .recipes import resolve

    return resolve(cfg)


def _data_task(d: dict, *, explicit_task: bool) -> dict:
    """``data.train_files`` set → the task is ``files`` built from the data section."""
    data = d.get("data") or {}
    if not isinstance(data, dict) or not data.get("train_files"):
        if isinstance(data, dict) and data.get("val_files"):
            raise ConfigError("data.val_files: set data.train_files too (validation data belongs to a files task)")
        return d
    if explicit_task:
        raise ConfigError("data.train_files and task are both set: data.train_files builds the task (files); "
                          "remove task, or drop data.train_files and use the task's own arguments")
    keys = ("train_files", "val_files", "prompt_key", "max_prompt_length", "overlong_prompts", "rewards")
    return {**d, "task": {"name": "files", **{k: data[k] for k in keys if k in data}}}


def _check_parallel(cfg: TrainConfig) -> None:
    """Tensor parallelism: what it combines with, and the engine's TP degree (1 or the trainer's)."""
    import os

    tp, eng = cfg.run.tp, cfg.rollout.engine
    etp = int(eng.args.get("tp", 1)) if eng.name == "transformers" else 1
    if etp != tp:  # the TP engine broadcasts its group's sampled tokens: the ranks of a TP group train on one batch
        raise ConfigError(f"rollout.engine={eng.name} with tp={etp}: run.tp={tp} needs the engine split the same "
                          f"way — rollout.engine={{name: transformers, tp: {tp}}} — so that the ranks of a TP group "
                          f"generate one batch together (separate engines may sample different rows)")
    if tp == 1:
        return
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp or world == 1:
        raise ConfigError(f"run.tp={tp}: needs torchrun with a multiple of {tp} processes (WORLD_SIZE={world})")
    for bad, why in ((cfg.model.lora is not None, "model.lora (the adapters' base is replicated, not split)"),
                     (bool(cfg.model.compile), "model.compile")):
        if bad:
            raise ConfigError(f"run.tp={tp} with {why} is not supported; set run.tp=1")


def _check_rewards(cfg: TrainConfig) -> None:
    """Every reward resolves (:func:`hyperrl.rewards.check_rewards`) — without building a reward model."""
    from .registry import HyperparameterError
    from .rewards import RewardError, check_rewards

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
    from .tokenizer import TOKENIZER_FILES

    tok = m.tokenizer or m.checkpoint
    if tok is not None and not any((Path(tok) / f).is_file() for f in TOKENIZER_FILES):
        key = "model.tokenizer" if m.tokenizer else "model.checkpoint"
        raise ConfigError(f"{key}: {tok} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save it with "
                          "tokenizer.save_pretrained(dir) or point model.tokenizer at the tokenizer's directory")


def describe() -> str:
    """Every key with its default and one line of doc, then every registered variant with its
    hyperparameters (``hyperrl config``)."""
    lines = []

    def walk(inst, prefix: str):
        for name, f in type(inst).model_fields.items():
            v = getattr(inst, name)
            if isinstance(v, BaseModel) and not isinstance(v, Variant):
                walk(v, f"{prefix}{name}.")
                continue
            shown = _plain(v)
            lines.append(f"{prefix}{name} = {shown!r}" + (f"  # {f.description}" if f.description else ""))

    walk(load_config(), "")
    from .recipes import registries

    lines.append("")
    lines.append("Variants (a section names one: {name: x, arg: value}); the factory's defaults:")
    for key, reg in registries().items():
        lines.append(f"{key}: {reg.kind}")
        for n in reg.names():
            f = reg.factory(n)
            args = ", ".join(f"{p.name}={p.default!r}" if not p.required else f"{p.name} (required)"
                             for p in f.params.values())
            needs = f"  needs {list(f.needs)}" if f.needs else ""
            lines.append(f"  {n}({args}){needs}")
    from .recipes import RECIPES

    lines.append("algo.recipe: named chains")
    for n in RECIPES.names():
        lines.append(f"  {n}: {RECIPES.factory(n).doc}")
    return "\n".join(lines)
