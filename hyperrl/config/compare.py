"""What makes two runs the same run: the keys that decide whether a checkpoint's weights load into
this run's model (:data:`LOADABILITY`), and the flat difference of two configs — so a resume never
mixes runs and every changed hyperparameter is said."""

from __future__ import annotations

from pathlib import Path

__all__ = ["LOADABILITY", "LAYOUT", "BOOKKEEPING", "flatten", "config_changes", "loadability_changes",
           "refuse_resume"]

# a different value here means another model: its weights (or its shards) are not this run's
LOADABILITY = ("model.checkpoint", "model.tokenizer", "model.lora", "run.tp", "run.ep")
# of those, the parallel layout a checkpoint's shards were saved in (the same model, laid out otherwise)
LAYOUT = ("run.tp", "run.ep")
_TINY = ("model.hidden", "model.layers", "model.heads", "model.kv_heads", "model.head_dim", "model.intermediate")
# keys that say where a run writes and how long it goes, not what it trains: never listed as changes
BOOKKEEPING = ("run.out_dir", "run.steps", "run.eval_every", "run.eval_prompts", "run.eval_n", "run.log_completions",
               "run.keep_last_k", "run.export", "run.ckpt_every", "run.threads", "run.keep_freed_memory",
               "run.wandb_project", "run.fingerprints", "run.fingerprint_values", "run.profile",
               "run.doctor_above")


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


def refuse_resume(run_dir, other: dict[str, tuple]) -> str:
    """Why a checkpoint of ``run_dir`` cannot be resumed, given :func:`loadability_changes`' ``other``: a changed
    parallel layout (:data:`LAYOUT` alone) is named as such — its shards are laid out for the old degrees — else
    the checkpoint is another model's run."""
    said = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in other.items())
    if set(other) <= set(LAYOUT):
        return (f"{run_dir} was saved with another parallel layout ({said}): its checkpoint's shards are laid out "
                f"for the saved degrees — resume with the same {', '.join(other)} (a checkpoint is not resharded on "
                "load), or --no-resume to start fresh here (its checkpoints are set aside)")
    return (f"{run_dir} holds another model's run ({said}) — resuming would mix the runs; set run.out_dir to a new "
            "directory, or --no-resume to start fresh here (its checkpoints are set aside)")
