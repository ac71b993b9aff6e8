"""Model builders from the config's ``model`` section: the tokenizer, the policy (a local HF
checkpoint or a tiny random Qwen3, with LoRA adapters when configured), the frozen reference and
the critic. ``cfg`` is read duck-typed (this layer sits below :mod:`hyperrl.config`)."""

from __future__ import annotations

import copy

from hyperrl.device import torch_dtype
from hyperrl.models.critic import ValueModel
from hyperrl.models.lora import AdapterDisabled, apply_lora
from hyperrl.models.tiny import tiny_qwen2_5_vl, tiny_qwen3, tiny_qwen3_moe
from hyperrl.multimodal import VISION_SPECIAL_TOKENS, suppress_outputs, vision_spec
from hyperrl.tokenizer import (
    DEFAULT_ALPHABET,
    TokenizerError,
    char_tokenizer,
    check_vocab,
    load_tokenizer,
    read_chat_template,
)

__all__ = ["build_tokenizer", "build_policy", "build_reference", "build_critic", "build_teachers", "same_tokenizer",
           "build_image_processor", "load_image_processor", "is_vision_checkpoint"]


def _tiny(cfg, tok, seed: int):
    """The tiny random Qwen3 of the ``model`` section, sized to the tokenizer (a Qwen3-MoE when
    ``model.experts`` > 0)."""
    m = cfg.model
    if m.vision is not None:
        v = m.vision
        ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_SPECIAL_TOKENS}
        return tiny_qwen2_5_vl(len(tok), image_token_id=ids["<|image_pad|>"], vision_start_id=ids["<|vision_start|>"],
                               vision_end_id=ids["<|vision_end|>"], video_token_id=ids["<|video_pad|>"],
                               hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                               intermediate=m.intermediate, vision_hidden=v.hidden, vision_depth=v.depth,
                               vision_heads=v.heads, rope_theta=v.rope_theta, seed=seed, pad_id=tok.pad_token_id,
                               eos_id=tok.eos_token_id, bos_id=tok.bos_token_id)
    if m.experts:
        return tiny_qwen3_moe(len(tok), experts=m.experts, top_k=m.experts_per_token,
                              moe_intermediate=m.moe_intermediate, router_aux_loss_coef=m.router_aux_loss_coef,
                              hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                              head_dim=m.head_dim, seed=seed, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id,
                              eos_id=tok.eos_token_id)
    return tiny_qwen3(len(tok), hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                      head_dim=m.head_dim, intermediate=m.intermediate, seed=seed, pad_id=tok.pad_token_id,
                      bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)


def build_tokenizer(cfg):
    """The model's own tokenizer (``model.tokenizer``, else the checkpoint's directory), or the
    embedded character tokenizer for the random-init default (over ``model.alphabet`` when set);
    ``model.chat_template`` replaces its template."""
    src = cfg.model.tokenizer or cfg.model.checkpoint
    tok = load_tokenizer(src) if src else char_tokenizer(cfg.model.alphabet or DEFAULT_ALPHABET,
                                                         specials=VISION_SPECIAL_TOKENS if cfg.model.vision else ())
    if cfg.model.chat_template is not None:
        tok.chat_template = read_chat_template(cfg.model.chat_template)
    return tok


def build_policy(cfg, tok, *, seed_offset: int = 0, lora: bool = True):
    """The causal LM: ``model.checkpoint`` (local HF directory) or a tiny random Qwen3 sized to the
    tokenizer, in ``model.param_dtype``, with ``model.lora`` adapters when configured (and
    ``lora``). A tokenizer with ids the model cannot embed is an error."""
    m, dt = cfg.model, torch_dtype(cfg.model.param_dtype)
    if m.checkpoint:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if is_vision_checkpoint(m.checkpoint) else AutoModelForCausalLM
        policy = auto.from_pretrained(m.checkpoint, dtype=dt)
        check_vocab(tok, _vocab_size(policy.config), "model.checkpoint")
    else:
        policy = _tiny(cfg, tok, cfg.run.seed + seed_offset).to(dt)
    spec = vision_spec(policy)
    if spec is not None:  # the placeholders and vision start/end are read, never generated (engine and trainer alike)
        suppress_outputs(policy, spec.input_only)
        if m.vision is not None and m.vision.freeze:
            policy.model.visual.requires_grad_(False)
    if lora and m.lora is not None:
        policy = apply_lora(policy, **m.lora.model_dump())
    return policy


def _vocab_size(config) -> int:
    """The output vocabulary (a vision-language config keeps it on its ``text_config``)."""
    return getattr(config, "vocab_size", None) or config.get_text_config().vocab_size


def is_vision_checkpoint(path: str) -> bool:
    """The checkpoint at ``path`` is a vision-language model (its config has a ``vision_config``)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def load_image_processor(path):
    """A checkpoint's image processor (``preprocessor_config.json``): ``AutoImageProcessor``, or — where
    torchvision is not installed, which transformers 5's ``AutoImageProcessor`` requires — the Pillow class of the
    same processor (``<image_processor_type>Pil``, e.g. ``Qwen2VLImageProcessorPil``)."""
    import json
    from pathlib import Path

    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(path)
    except ImportError:
        kind = json.loads((Path(path) / "preprocessor_config.json").read_text()).get("image_processor_type", "")
        cls = getattr(transformers, kind.removesuffix("Fast") + "Pil", None)
        if cls is None:
            raise
        return cls.from_pretrained(path)


def build_image_processor(cfg):
    """A vision-language policy's image processor: the checkpoint's own (``preprocessor_config.json``), or for the
    tiny random Qwen2.5-VL a Qwen2-VL processor with its patch (14) / temporal patch (2) / merge (2) sizes and
    ``model.vision``'s pixel bounds (the Pillow implementation: no torchvision needed). None for a text model."""
    m = cfg.model
    if m.checkpoint:
        return load_image_processor(m.checkpoint) if is_vision_checkpoint(m.checkpoint) else None
    if m.vision is None:
        return None
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=m.vision.min_pixels, max_pixels=m.vision.max_pixels, patch_size=14,
                                    temporal_patch_size=2, merge_size=2)


def build_reference(cfg, policy, needed: bool):
    """``model.lora``: adapters applied to ``policy`` (the engine was built from the base: B = 0),
    and the reference is the base itself — adapters disabled, no copy. Otherwise the reference is a
    frozen copy kept in the compute dtype (no optimizer, no master copy). Returns ``(policy,
    reference)``; the reference is None when not ``needed``."""
    m = cfg.model
    if m.lora is not None:
        policy = apply_lora(policy, **m.lora.model_dump())
        return policy, (AdapterDisabled(policy) if needed else None)
    if not needed:
        return policy, None
    return policy, copy.deepcopy(policy).to(torch_dtype(m.dtype)).eval().requires_grad_(False)


def build_critic(cfg, tok, hidden: int) -> ValueModel:
    """The critic: the checkpoint's backbone (verl initialises the critic from the actor's model) or
    a tiny random one, with a zero-initialised value head, in ``model.param_dtype``."""
    backbone = build_policy(cfg, tok, seed_offset=1, lora=False).model
    return ValueModel(backbone, hidden).to(torch_dtype(cfg.model.param_dtype))


def same_tokenizer(a, b) -> str | None:
    """Why tokenizers ``a`` and ``b`` would map the same text to different ids (None when they agree): their
    vocabularies (token → id) and their special ids (eos, pad, bos)."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only_a, only_b = sorted(set(va) - set(vb))[:3], sorted(set(vb) - set(va))[:3]
        moved = sorted(t for t in set(va) & set(vb) if va[t] != vb[t])[:3]
        return (f"vocabularies differ ({len(va)} vs {len(vb)} tokens; only in the student: {only_a}, only in the "
                f"teacher: {only_b}, other ids: {moved})")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(a, name, None) != getattr(b, name, None):
            return f"{name} differs ({getattr(a, name, None)} vs {getattr(b, name, None)})"
    return None


def build_teachers(cfg, tok, device) -> dict:
    """``algo.distill``'s teachers: data_source → frozen causal LM in ``model.dtype`` on ``device`` (key None
    for a single ``teacher``). Each is a Hugging Face directory whose tokenizer must equal the student's
    (``tok``) — the teacher scores the student's own token ids, never re-tokenised text."""

    d = cfg.algo.distill
    if d is None:
        return {}
    paths = {None: d.teacher} if d.teacher is not None else dict(d.teachers)
    student = cfg.model.tokenizer or cfg.model.checkpoint or "the embedded character tokenizer"
    out, loaded = {}, {}
    for source, path in paths.items():
        key = "algo.distill.teacher" if source is None else f"algo.distill.teachers.{source}"
        try:
            theirs = load_tokenizer(path)
        except TokenizerError as e:
            raise ValueError(f"{key}={path}: {e}") from None
        why = same_tokenizer(tok, theirs)
        if why is not None:
            raise ValueError(f"{key}={path}: its tokenizer is not the student's ({student}): {why} — distillation "
                             "scores the student's token ids with the teacher, so both must tokenize alike")
        if path not in loaded:  # one model per directory, however many data sources share it
            loaded[path] = _load_teacher(path, key, torch_dtype(cfg.model.dtype), device)
            check_vocab(tok, loaded[path].config.vocab_size, key)
        out[source] = loaded[path]
    return out


def _load_teacher(path: str, key: str, dtype, device):
    """A teacher directory → its frozen model; what cannot be loaded (a corrupt ``config.json``, truncated or
    missing weights) or holds NaN / inf weights is a ``ValueError`` naming ``key``, the directory and why — found
    at load, not as the student's refused publication many steps later."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - transformers / safetensors raise many kinds: one line, named
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{key}={path}: the teacher cannot be loaded ({type(e).__name__}: {first[:300]}) — a "
                         "teacher is a complete Hugging Face directory: config.json and its weights "
                         "(model.safetensors), as save_pretrained writes them") from None
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise ValueError(f"{key}={path}: the teacher's weights hold NaN or inf ({len(bad)} tensors: "
                         f"{', '.join(bad[:3])}{' …' if len(bad) > 3 else ''}) — a diverged or damaged checkpoint; "
                         "its log-probs would poison the distillation loss")
    return model.to(device).eval().requires_grad_(False)
