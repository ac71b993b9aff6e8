"""Context parallelism by head exchange (DeepSpeed-Ulysses; verl's Ulysses sequence parallelism,
MindSpeed-RL's long-sequence parallelism): each rank of a ``cp`` group holds a contiguous slice of every
sequence; attention, the one operation that mixes positions, exchanges heads for sequence with an
all-to-all so each rank attends over the *whole* sequence for ``heads / cp`` of the heads, then
exchanges back. Everything else (projections, norms, MLP or experts, the LM head) runs on the local
slice unchanged.

:func:`ulysses_attention` is a transformers attention function (``AttentionInterface``): queries
``[B, h, S/cp, D]`` (already rotated with the slice's *global* positions) → all-to-all → ``[B, h/cp, S,
D]`` → causal SDPA over the full sequence → all-to-all back → ``[B, S/cp, h, D]``. The causal mask is
built over the full sequence, so rows must be right-padded (a real token never sees padding); packed
sequences (several rows concatenated, positions restarting at 0) attend within their own row under
:func:`packed_segments`, which hands the attention the whole sequence's segment ids. Key/value heads
are repeated to the query heads first when they do
not divide by ``cp`` (grouped-query attention). The exchange is the functional collectives' autograd
all-to-all: the backward is the reverse exchange. Written here because torch and transformers ship no
Ulysses attention for a Hugging Face model.

:func:`context_parallel` switches a model to it for a ``cp`` process group; :func:`split_sequence` cuts a
batch's tokens and positions into this rank's slice.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["ulysses_attention", "context_parallel", "split_sequence", "gather_sequence", "packed_segments"]

_GROUPS: dict[int, object] = {}  # id(model config) → its cp process group
_SEGMENTS: dict[int, torch.Tensor] = {}  # id(model config) → the packed sequence's segment ids [B, S]


@contextlib.contextmanager
def packed_segments(model: torch.nn.Module, segments: torch.Tensor):
    """Within this context ``model``'s Ulysses attention is block-diagonal causal: position ``i`` attends
    to ``j ≤ i`` of the same segment (``segments [B, S]``: the whole — not the local — sequence's ids,
    e.g. its packed rows' indices)."""
    keys = {id(model.config)} | {id(m.config) for m in model.modules() if getattr(m, "config", None)
                                 is not None}
    for k in keys:
        _SEGMENTS[k] = segments
    try:
        yield
    finally:
        for k in keys:
            _SEGMENTS.pop(k, None)


def _a2a(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """All-to-all over ``group``: ``x`` split into ``cp`` chunks along ``scatter`` (chunk ``j`` to rank
    ``j``), the received chunks concatenated along ``gather`` in rank order. Differentiable."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    cp = dist.get_world_size(group)
    chunks = torch.stack(x.chunk(cp, dim=scatter))  # [cp, …]
    flat = chunks.reshape(cp, -1)
    out = wait_tensor(all_to_all_single_autograd(flat.contiguous(), None, None, group))
    parts = out.reshape(chunks.shape).unbind(0)  # parts[j]: what rank j sent (its slice along `gather`)
    return torch.cat(parts, dim=gather)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention over the whole sequence from this rank's slice (see the module doc); returns
    ``(out [B, S/cp, h, D], None)`` like transformers' SDPA function."""
    group = _GROUPS[id(module.config)]
    cp = dist.get_world_size(group)
    h, hk = query.shape[1], key.shape[1]
    if h % cp:
        raise ValueError(f"run.cp={cp}: must divide the attention heads ({h}) — Ulysses splits heads over ranks")
    if hk % cp:  # grouped-query attention with fewer kv heads than ranks: repeat them to the query heads
        key, value = (t.repeat_interleave(h // hk, dim=1) for t in (key, value))
    q, k, v = (_a2a(t, group, scatter=1, gather=2) for t in (query, key, value))  # [B, h/cp, S, D]
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    seg = _SEGMENTS.get(id(module.config))
    if seg is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                               dropout_p=dropout)
    else:  # packed rows: causal within each segment only
        S = q.shape[2]
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        mask = causal & (seg[:, :, None] == seg[:, None, :]).to(q.device)  # [B, S, S]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scaling,
                                                               dropout_p=dropout)
    out = _a2a(out, group, scatter=2, gather=1)  # [B, h, S/cp, D]
    return out.transpose(1, 2).contiguous(), None


def context_parallel(model: torch.nn.Module, group) -> torch.nn.Module:
    """Run ``model``'s attention as :func:`ulysses_attention` over ``group`` (in place)."""
    from transformers import AttentionInterface

    AttentionInterface.register("hyperrl_ulysses", ulysses_attention)
    _GROUPS[id(model.config)] = group
    model.config._attn_implementation = "hyperrl_ulysses"
    for m in model.modules():  # sub-configs (a VLM's text model) share the switch
        cfg = getattr(m, "config", None)
        if cfg is not None and cfg is not model.config:
            _GROUPS[id(cfg)] = group
            cfg._attn_implementation = "hyperrl_ulysses"
    return model


def split_sequence(tokens: torch.Tensor, group, pad_id: int = 0,
                   position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's slice of ``tokens [B, T]``: right-padded with ``pad_id`` to a multiple of ``cp``, cut
    into ``cp`` contiguous slices; returns ``(tokens [B, T'/cp], position_ids [B, T'/cp], T')`` — the
    slice of ``position_ids [B, T]`` when given (continued past ``T`` on the padding), else ``0 … T'−1``."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    B, T = tokens.shape
    Tp = -(-T // cp) * cp
    padded = torch.nn.functional.pad(tokens, (0, Tp - T), value=pad_id)
    n = Tp // cp
    if position_ids is None:
        pos = torch.arange(r * n, (r + 1) * n, device=tokens.device).expand(B, n)
    else:
        tail = position_ids[:, -1:] + torch.arange(1, Tp - T + 1, device=tokens.device)[None]
        pos = torch.cat([position_ids, tail], 1)[:, r * n:(r + 1) * n]
    return padded[:, r * n:(r + 1) * n], pos, Tp


def gather_sequence(x: torch.Tensor, group, T: int) -> torch.Tensor:
    """The slices ``x [B, T'/cp, …]`` of every rank of ``group`` concatenated along dim 1 and cut to
    ``T`` (differentiable: the backward hands each rank its slice's gradient)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    cp = dist.get_world_size(group)
    full = wait_tensor(all_gather_single_autograd(x.contiguous(), gather_dim=0, group=group))  # [cp·B, n, …]
    B = x.shape[0]
    return torch.cat(full.split(B, dim=0), dim=1)[:, :T] if cp > 1 else x[:, :T]
