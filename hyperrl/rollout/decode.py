"""The transformers engine's own decode step for the Llama family: one token per row through the model's weights.

Per decoded token, a transformers model's forward spends more of a small model's time around its matrix
products than in them: module calls, the attention mask rebuilt for the whole past, the cache's
bookkeeping, and torch's CPU flash kernel, which at a query of one token costs ≈ 2.5× a plain
``softmax(q kᵀ) v`` (measured: 128 rows, 2 KV heads × 2 groups, 44 cached tokens — 261 µs against 106). For the
families whose decoder layer is exactly pre-norm attention + gated MLP (Llama, Mistral without a
window, Qwen2, Qwen3 — :data:`FAMILIES`), :class:`DecodeStep` reads the same modules' weights and runs the same
operations in the same order — RMSNorm as transformers computes it, the model's own rotary module (a static
rotary's cos / sin tabled once a generation) and activation, the K/V written in place into the engine's cache
(:mod:`hyperrl.rollout.kv_cache`) — with the attention as two matrix products over the cache's filled part,
the padding masked by ``−inf``. Every number but the attention's is transformers' bit for bit; the attention's
differ in rounding (≈ 1e-6 relative in fp32; ``tests/rollout/test_decode.py``). The prefill, and every model
outside the family or with anything hooked into it, stays on the model's forward (:func:`decode_step` says why).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch.nn import functional as F

__all__ = ["FAMILIES", "Decode", "DECODE", "DecodeStep", "decode_step", "why_not"]

# the engine's choice (``rollout.engine.decode``): the own step where it can / the own step or refuse / the model's
# forward every token
Decode = Literal["auto", "hyperrl", "model"]
DECODE = get_args(Decode)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # rotary types whose frequencies do not change with the length


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm on fp32 ``x [..., D]``: ``w · x / sqrt(mean(x²) + eps)`` — its numbers bit for bit
    (``x²`` is ``x · x``; the same products in the same order), its temporaries written in place."""
    return (x * torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` (the rotary embedding, transformers' op order), ``x [B, H, D]``."""
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat((-b, a), -1) * sin


def _stacked(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases: zeros for one without, when another has one) of ``linears`` stacked by output."""
    w = torch.cat([m.weight for m in linears])
    if all(m.bias is None for m in linears):
        return w, None
    return w, torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in linears])


def _hooked(model: torch.nn.Module) -> str | None:
    """The first module with a forward hook, or an instance-level ``forward`` (a patched model), if any."""
    from torch.nn.modules import module as mod

    if mod._global_forward_hooks or mod._global_forward_pre_hooks:
        return "a global forward hook"
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m):
            return f"module {name or type(m).__name__!r} is hooked or its forward replaced"
    return None


def why_not(model: torch.nn.Module) -> str | None:
    """Why :class:`DecodeStep` cannot stand in for ``model``'s forward (None: it can). Checked at every
    generation: a hook attached later (a router tap, a debugging patch) sends the engine back to the model."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in FAMILIES:
        return f"model family {family!r} is not one of {FAMILIES}"
    from hyperrl.rollout.kv_cache import full_attention_only

    if not full_attention_only(model):
        return "a layer attends to a window, not the whole past"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp={cfg.pretraining_tp}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return "no model.layers / a plain lm_head"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return "the embedding is not a plain nn.Embedding"
    dtype = inner.embed_tokens.weight.dtype
    if dtype != torch.float32:
        return f"dtype {str(dtype).removeprefix('torch.')} (the own step runs fp32 models)"
    for i, layer in enumerate(layers):
        a, m = layer.self_attn, layer.mlp
        linears = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if any(type(p) is not torch.nn.Linear for p in linears):
            return f"layer {i}: a projection is not a plain nn.Linear (LoRA, tensor parallel, quantised)"
        if getattr(a, "sliding_window", None) is not None:
            return f"layer {i}: sliding window"
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [getattr(a, n) for n in ("q_norm", "k_norm")
                                                                          if hasattr(a, n)]
        if any(not type(n).__name__.endswith("RMSNorm") or not hasattr(n, "variance_epsilon") for n in norms):
            return f"layer {i}: a norm is not transformers' RMSNorm"
    return _hooked(model)


class DecodeStep:
    """``(tokens [B], positions [B, 1], cache, attention_mask [B, n + 1]) → logits [B, V]`` for one new
    token a row, the K/V written at position ``n`` of every layer's preallocated cache (see the module doc)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.inner = model, model.model
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Qwen3 normalises each query and key head: one RMSNorm over the [B, H + Hk, D] query-and-key heads with
        # their weights side by side (the same numbers as two norms, half the ops); taken per generation
        D = self.head_dim
        self.qk_norms = [None if not hasattr(a, "q_norm") else
                         (torch.cat([a.q_norm.weight.expand(self.heads, D), a.k_norm.weight.expand(self.kv_heads, D)]),
                          a.q_norm.variance_epsilon)
                         for a in (layer.self_attn for layer in self.inner.layers)]
        # a rotary whose frequencies do not depend on the length (not dynamic / longrope): its cos / sin for every
        # position computed once by the model's own module, then looked up (the same numbers: one product a
        # frequency and position, then cos / sin)
        self._static_rope = getattr(self.inner.rotary_emb, "rope_type", None) in STATIC_ROPE
        self._cos = self._sin = None
        # the query, key and value projections as one matrix product (their weights stacked once a build): the
        # same numbers as three (each output is the same dot product; checked bit for bit in
        # tests/rollout/test_decode.py), one call instead of three and no concatenation of q and k
        self.qkv = [_stacked(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in self.inner.layers)]

    def _rope(self, h: torch.Tensor, positions: torch.Tensor, length: int):
        """cos, sin ``[B, 1, D]`` at ``positions [B, 1]`` (every position ``< length``)."""
        if not self._static_rope:
            return self.inner.rotary_emb(h, positions)
        if self._cos is None or self._cos.shape[0] < length:
            grid = torch.arange(max(2 * length, 64), device=h.device)[None]
            cos, sin = self.inner.rotary_emb(h, grid)
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[positions], self._sin[positions]

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache, attention_mask: torch.Tensor):
        H, Hk, D = self.heads, self.kv_heads, self.head_dim
        h = self.inner.embed_tokens(tokens)  # [B, hidden]
        cos, sin = self._rope(h, positions, attention_mask.shape[1])  # [B, 1, D]: the model's own rotary
        bias = torch.zeros(attention_mask.shape, dtype=h.dtype, device=h.device).masked_fill_(attention_mask == 0,
                                                                                              float("-inf"))
        bias = bias[:, None, None, :]  # [B, 1, 1, n + 1]
        for i, layer in enumerate(self.inner.layers):
            a, m = layer.self_attn, layer.mlp
            x = _rms(h, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            qkv = F.linear(x, *self.qkv[i]).view(-1, H + 2 * Hk, D)
            qk, v = qkv[:, :H + Hk], qkv[:, H + Hk:, None]  # the query and key heads side by side: one norm, one
            # rotation
            if self.qk_norms[i] is not None:
                qk = _rms(qk, *self.qk_norms[i])
            qk = _rotate(qk, cos, sin)
            keys, values = cache.layers[i].update(qk[:, H:, None], v)  # [B, Hk, n + 1, D]
            s = torch.matmul(qk[:, :H].view(-1, Hk, H // Hk, D), keys.transpose(-1, -2)).mul_(a.scaling).add_(bias)
            o = torch.matmul(torch.softmax(s, -1), values).reshape(-1, H * D)
            h = h + F.linear(o, a.o_proj.weight, a.o_proj.bias)
            x = _rms(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            gate = F.linear(x, m.gate_proj.weight, m.gate_proj.bias)
            h = h + F.linear(m.act_fn(gate) * F.linear(x, m.up_proj.weight, m.up_proj.bias), m.down_proj.weight,
                             m.down_proj.bias)
        return self.model.lm_head(_rms(h, self.inner.norm.weight, self.inner.norm.variance_epsilon))


def decode_step(model: torch.nn.Module) -> tuple[DecodeStep | None, str | None]:
    """``(step, None)`` where :class:`DecodeStep` can run ``model``'s decode, else ``(None, why)``."""
    why = why_not(model)
    return (None, why) if why else (DecodeStep(model), None)
