"""Model builders from the config's ``model`` section: the tokenizer, the policy (a local HF
checkpoint or a tiny random Qwen3, with LoRA adapters when configured), the frozen reference and
the critic. ``cfg`` is read duck-typed (this layer sits below :mod:`hyperrl.config`)."""

from __future__ import annotations

import copy

from hyperrl.device import torch_dtype
from hyperrl.models.critic import ValueModel
from hyperrl.models.lora import AdapterDisabled, apply_lora
from hyperrl.models.tiny import tiny_qwen3, tiny_qwen3_moe
from hyperrl.tokenizer import char_tokenizer, check_vocab, load_tokenizer

__all__ = ["build_tokenizer", "build_policy", "build_reference", "build_critic"]


def _tiny(cfg, tok, seed: int):
    """The tiny random Qwen3 of the ``model`` section, sized to the tokenizer (a Qwen3-MoE when
    ``model.experts`` > 0)."""
    m = cfg.model
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
    embedded character tokenizer for the random-init default."""
    src = cfg.model.tokenizer or cfg.model.checkpoint
    return load_tokenizer(src) if src else char_tokenizer()


def build_policy(cfg, tok, *, seed_offset: int = 0, lora: bool = True):
    """The causal LM: ``model.checkpoint`` (local HF directory) or a tiny random Qwen3 sized to the
    tokenizer, in ``model.param_dtype``, with ``model.lora`` adapters when configured (and
    ``lora``). A tokenizer with ids the model cannot embed is an error."""
    m, dt = cfg.model, torch_dtype(cfg.model.param_dtype)
    if m.checkpoint:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(m.checkpoint, dtype=dt)
        check_vocab(tok, policy.config.vocab_size, "model.checkpoint")
    else:
        policy = _tiny(cfg, tok, cfg.run.seed + seed_offset).to(dt)
    if lora and m.lora is not None:
        policy = apply_lora(policy, **m.lora.model_dump())
    return policy


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
