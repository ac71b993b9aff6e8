"""Frozen run configuration at the edge: YAML files plus dotted overrides, unknown keys rejected.

Pure transforms never see these objects; the trainer reads the scalars and passes them on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ModelConfig", "TaskConfig", "RolloutConfig", "AlgoConfig", "OptimConfig", "RunConfig", "TrainConfig",
           "load_config", "ConfigError"]


class ConfigError(ValueError):
    """A bad config key or value; the message names the dotted key."""


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    checkpoint: str | None = None  # a local HF checkpoint directory instead of a random init


@dataclass(frozen=True)
class TaskConfig:
    name: str = "modsum"  # modsum (synthetic, in code) | parquet
    modulus: int = 10
    max_operand: int = 9
    parquet: str | None = None
    reward: str = "gsm8k_exact"
    environment: str | None = None  # a registered multi-turn environment (e.g. gsm8k_calculator)
    max_turns: int = 3


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "transformers"  # hyperrl.train.ENGINES: transformers (any device) | vllm (vllm / -ascend / -cpu)
    prompts_per_step: int = 32
    n: int = 16
    max_new_tokens: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class AlgoConfig:
    estimator: str = "grpo"
    objective: str = "ppo_clip"
    agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher: keeps the embedded default from collapsing its entropy
    eps: float = 1e-6
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.05  # with clip-higher: ≥ 0.9 held-out on 5/5 seeds (docs/trainer.md)
    ppo_epochs: int = 1
    overlong_buffer: int = 0  # DAPO soft overlong punishment (0 = off)
    dynamic_sampling: bool = False
    gate_threshold: float | None = None  # bit-exact gate: refuse the update above this logprob gap
    # PPO with a critic (estimator: gae)
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    value_coef: float = 1.0
    critic_lr: float = 0.003
    whiten_advantages: bool = True


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout batch
    micro_batch_tokens: int = 0  # gradient-accumulation budget per micro-batch (0 = whole mini-batch)
    shared_prefix: bool = True  # run each distinct prompt once per forward (hyperrl.forward), when cheaper
    schedule: str = "constant"  # lr schedule (hyperrl.schedules.SCHEDULES): constant | linear | cosine
    warmup_steps: int = 0  # linear warmup, in optimizer steps
    min_lr_ratio: float = 0.0  # where linear/cosine end, as a fraction of lr


@dataclass(frozen=True)
class RunConfig:
    steps: int = 1000
    seed: int = 0
    eval_every: int = 100
    eval_prompts: int = 256
    ckpt_every: int = 0  # 0 = only at the end
    out_dir: str = "runs/default"
    device: str = "cpu"
    threads: int = 0  # 0 = torch default
    wandb_project: str = ""  # log to Weights & Biases under this project (needs `pip install wandb`)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(key: str, value: Any, typ) -> Any:
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    if value is None:
        if "None" in typ:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {typ})")
    try:
        if typ.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ.startswith("float"):
            return float(value)
        if typ.startswith("bool"):
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return bool(value)
        if typ.startswith("tuple"):
            seq = yaml.safe_load(value) if isinstance(value, str) else value
            return tuple(float(v) for v in seq)
        if "int | None" in typ:
            return int(value)
        if "float | None" in typ:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: {value!r} is not a valid {typ}") from None


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}; valid keys under "
                          f"{prefix.rstrip('.') or 'the top level'}: {sorted(fields)}")
    kw = {}
    for name, f in fields.items():
        if name not in data:
            continue
        if dataclasses.is_dataclass(f.default_factory() if f.default_factory is not dataclasses.MISSING else None):
            kw[name] = _build(type(f.default_factory()), data[name], f"{prefix}{name}.")
        else:
            kw[name] = _coerce(prefix + name, data[name], f.type)
    return cls(**kw)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults ← YAML file ← ``--a.b=value`` overrides (values parsed as YAML scalars)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
    for item in overrides:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected --section.key=value")
        key, raw = item.split("=", 1)
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return _build(TrainConfig, data, "")
