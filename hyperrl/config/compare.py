"""What makes two runs the same run: the keys that decide whether a checkpoint's weights load into
this run's model (:data:`LOADABILITY`), and the flat difference of two configs — so a resume never
mixes runs and every changed hyperparameter is said."""

from __future__ import annotations

from pathlib import Path

__all__ = ["LOADABILITY", "BOOKKEEPING", "flatten", "config_changes", "loadability_changes"]

# a different value here means another model: its weights (or its shards) are not this run's
LOADABILITY = ("model.checkpoint", "model.tokenizer", "model.lora", "run.tp")
_TINY = ("model.hidden", "model.layers", "model.heads", "model.kv_heads", "model.head_dim", "model.intermediate")
# keys that say where a run writes and how long it goes, not what it trains: never listed as changes
BOOKKEEPING = ("run.out_dir", "run.steps", "run.eval_every", "run.eval_prompts", "run.eval_n", "run.log_completions",
               "run.keep_last_k", "run.export", "run.ckpt_every", "run.threads", "run.wandb_project")


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (variants and lists are values)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and "name" not in v and key != "model.lora":  # a variant or LoRA: one value
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _norm(key: str, v):
    if key in ("model.checkpoint", "model.tokenizer") and v:
        return str(Path(v).resolve())
    return v


def config_changes(old: dict, new: dict) -> dict[str, tuple]:
    """Every dotted key whose value differs (:data:`BOOKKEEPING` aside): ``key → (old, new)``."""
    import json

    a, b = flatten(json.loads(json.dumps(old))), flatten(json.loads(json.dumps(new)))  # tuples as JSON lists
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if k not in BOOKKEEPING and _norm(k, a.get(k)) != _norm(k, b.get(k))}


def loadability_changes(old: dict, new: dict) -> dict[str, tuple]:
    """The changes that make the checkpoint another model's (:data:`LOADABILITY`; a random-init
    model's sizes too)."""
    changes = config_changes(old, new)
    keys = set(LOADABILITY) | (set(_TINY) if not (flatten(new).get("model.checkpoint")) else set())
    return {k: v for k, v in changes.items() if k in keys or any(k.startswith(x + ".") for x in keys)}
