"""Export a checkpoint as a Hugging Face model directory that ``transformers`` and vLLM load:
``save_pretrained`` weights (full tensors, consolidated from every rank's shards), config,
generation config (the run's stop ids) and the tokenizer the run trained with.

``hyperrl export runs/x/checkpoints/step_1000 out/`` or at the end of ``hyperrl train`` (``run.export``).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["export_hf", "ExportError"]


class ExportError(ValueError):
    """A checkpoint that cannot be exported (incomplete, no model, foreign config)."""


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """The policy of ``checkpoint`` (a ``step_<k>`` directory of a hyperrl run) → ``out_dir``,
    in the run's compute dtype (``model.dtype``). Written to a temporary sibling and renamed, so
    a failure leaves nothing half-written."""
    import shutil

    from hyperrl.config import TrainConfig
    from hyperrl.device import torch_dtype
    from hyperrl.loop.checkpoint import MARKER, consolidate
    from hyperrl.models.policy import build_policy, build_tokenizer

    ck, out = Path(checkpoint), Path(out_dir)
    if not (ck / MARKER).exists():
        raise ExportError(f"{ck}: not a complete hyperrl checkpoint (no {MARKER} marker)")
    state = json.loads((ck / "state.json").read_text())
    if "config" not in state:
        raise ExportError(f"{ck}: state.json holds no run config")
    cfg = TrainConfig.model_validate(state["config"])
    tok = build_tokenizer(cfg)
    model = build_policy(cfg, tok)
    weights = consolidate(ck, "model")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if cfg.model.lora is not None:  # the checkpoint holds the adapters: every trainable tensor, nothing else
        missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in weights]
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"{ck}: model weights do not match the run's model (missing {sorted(missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]})")
    if cfg.model.lora is not None:
        model = model.merge_and_unload()  # a plain HF model with W + ΔW
    model = model.to(torch_dtype(cfg.model.dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
