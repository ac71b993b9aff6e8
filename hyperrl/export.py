"""Export a checkpoint as a Hugging Face model directory that ``transformers`` and vLLM load:
``save_pretrained`` weights (full tensors, consolidated from every rank's shards), config,
generation config (every stop id of the model: its own ``generation_config`` and the tokenizer's EOS)
and the tokenizer the run trained with — or, for a LoRA run, the adapters alone (``--adapters``).

``hyperrl export runs/x/checkpoints/step_1000 out/`` or at the end of ``hyperrl train`` (``run.export``).
"""

from __future__ import annotations

import json
from pathlib import Path

from hyperrl.errors import HyperRLError

__all__ = ["export_hf", "ExportError", "stop_ids"]


class ExportError(HyperRLError, ValueError):
    """A checkpoint that cannot be exported (incomplete, no model, foreign config)."""


def _located(cfg, ck: Path):
    """The run's config with ``model.checkpoint`` / ``model.tokenizer`` found: as recorded (absolute
    since the loader records them so), else relative to the run directory (``ck``'s
    ``…/checkpoints/step_k`` → the run); a directory that is really missing is an error naming it."""
    run_dir = ck.resolve().parent.parent
    m, found = cfg.model, {}
    for key in ("checkpoint", "tokenizer"):
        p = getattr(m, key)
        if p is None or Path(p).is_dir():
            continue
        alt = run_dir / p
        if not Path(p).is_absolute() and alt.is_dir():
            found[key] = str(alt)
            continue
        raise ExportError(f"{ck}: the run's model.{key} {p} does not exist (looked at {Path(p).resolve()}"
                          f"{'' if Path(p).is_absolute() else f' and {alt}'}); the export rebuilds the model from it "
                          "— restore that directory or export on the machine that trained")
    return cfg if not found else cfg.model_copy(update={"model": m.model_copy(update=found)})


def stop_ids(model, tok) -> list[int]:
    """Every id that ends a turn: the model's own ``generation_config.eos_token_id`` (a chat model
    lists several, e.g. Qwen's ``<|im_end|>`` and ``<|endoftext|>``), then the tokenizer's EOS."""
    from hyperrl.loop.generation import stop_ids_of

    ids = list(stop_ids_of(model))
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(int(tok.eos_token_id))
    return ids


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, adapters: bool = False) -> Path:
    """The policy of ``checkpoint`` (a ``step_<k>`` directory of a hyperrl run) → ``out_dir``,
    in the run's compute dtype (``model.dtype``), with ``generation_config.json`` carrying every stop
    id the model had (:func:`stop_ids`). ``adapters``: a LoRA run's adapters alone (PEFT's
    ``adapter_model.safetensors`` + ``adapter_config.json``, which PEFT and vLLM's LoRA load over
    the base) instead of merged weights. Written to a temporary sibling and renamed, so a failure
    leaves nothing half-written."""
    import shutil

    from hyperrl.config import TrainConfig
    from hyperrl.device import torch_dtype
    from hyperrl.loop.checkpoint import MARKER, consolidate, verify_checkpoint
    from hyperrl.models.policy import build_image_processor, build_policy, build_tokenizer
    from hyperrl.multimodal import vision_spec

    ck, out = Path(checkpoint), Path(out_dir)
    if not ck.is_dir():
        raise ExportError(f"{ck}: no such checkpoint directory (a run's checkpoints are "
                          "<out_dir>/checkpoints/step_<k>)")
    if not (ck / MARKER).exists():
        raise ExportError(f"{ck}: not a complete hyperrl checkpoint (no {MARKER} marker)")
    verify_checkpoint(ck)  # every file against its recorded checksum: a damaged file is named
    state = json.loads((ck / "state.json").read_text())
    if "config" not in state:
        raise ExportError(f"{ck}: state.json holds no run config")
    cfg = _located(TrainConfig.model_validate(state["config"]), ck)
    if adapters and cfg.model.lora is None:
        raise ExportError(f"{ck}: --adapters exports a LoRA run's adapters; this run trained every weight (no "
                          "model.lora) — export without --adapters")
    if adapters and cfg.model.lora.train_modules:
        raise ExportError(f"{ck}: model.lora.train_modules {cfg.model.lora.train_modules} were trained outside the "
                          "adapters and cannot travel in an adapter file — export without --adapters (merged)")
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
    stops = stop_ids(model, tok)
    if cfg.model.lora is not None and not adapters:
        model = model.merge_and_unload()  # a plain HF model with W + ΔW
    model = model.to(torch_dtype(cfg.model.dtype))
    gen = model.generation_config
    gen.eos_token_id = stops if len(stops) > 1 else stops[0] if stops else None
    gen.pad_token_id = tok.pad_token_id
    spec = vision_spec(model)
    if spec is not None:  # the trained policy never emits its vision tokens (suppressed at the head): nor does generate
        gen.suppress_tokens = list(spec.input_only)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # a PEFT model (adapters): adapter_config.json + adapter_model.safetensors
    if adapters:
        gen.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    processor = build_image_processor(cfg)
    if processor is not None:  # a vision-language model: its image processor (AutoImageProcessor loads it back)
        processor.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
