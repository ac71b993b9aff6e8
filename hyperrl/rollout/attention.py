"""Attention for the transformers rollout engine: torch's SDPA given the grouped K/V as they are.

transformers' ``sdpa`` attention repeats a grouped-query model's K/V heads to the query heads
(``repeat_kv``: a copy of the whole cache per layer per decoded token) whenever an attention mask is
given, because on CUDA ``enable_gqa`` with a mask falls back to the math kernel. A batched engine always
passes a mask (its prompts are left-padded), so on CPU every decode step copied its cache ``heads /
kv_heads`` times over. Torch's CPU kernel takes the mask and the groups together: measured on this
machine at a decode step of 128 rows, 4 query / 2 KV heads, 80 cached tokens, 0.48 ms against 2.4–3.9
ms repeated, and the same values bit for bit (``tests/rollout/test_rollout.py``).
"""

from __future__ import annotations

import torch

__all__ = ["GQA_SDPA", "gqa_sdpa_attention", "use_gqa_sdpa"]

GQA_SDPA = "hyperrl_gqa_sdpa"


def gqa_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """``softmax(q kᵀ · scaling + mask) v`` per head, ``query [B, H, S, D]``, ``key``/``value [B, H_kv, T, D]``
    (``H`` a multiple of ``H_kv``: query head ``h`` reads KV head ``h // (H / H_kv)``) → ``[B, S, H, D]``. The
    groups go to SDPA as they are (``enable_gqa``) on CPU, or where there is no mask; elsewhere K/V are
    repeated first (CUDA's fused kernels refuse a mask with groups). Causal without a mask for a multi-token
    query of a causal module, as transformers' ``sdpa``."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and not (query.device.type == "cpu" or attention_mask is None):
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=causal,
                                                           enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model``'s attention (and its sub-models') from transformers' ``sdpa`` to
    :func:`gqa_sdpa_attention`, in place; configs on another implementation are left as they are."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    # the masks transformers builds for sdpa (an unregistered name would get none: padding attended)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    seen = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        if getattr(cfg, "_attn_implementation", None) == "sdpa":
            cfg._attn_implementation = GQA_SDPA
    return model
