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
sequences (several rows concatenated, positions restarting at 0) attend within their own row when the model is
called with ``cp_segments=`` the whole sequence's segment ids ``[B, S]`` (a keyword argument, which transformers
passes down to the attention function — and which gradient checkpointing's recompute sees again). Key/value heads
are repeated to the query heads first when they do
not divide by ``cp`` (grouped-query attention). The exchange is the functional collectives' autograd
all-to-all: the backward is the reverse exchange. Written here because torch and transformers ship no
Ulysses attention for a Hugging Face model.

Ulysses cannot go past the query heads (each rank needs whole heads). :func:`ring_attention` (``run.cp_attention
= ring``; :mod:`hyperrl.distributed.ring_attention`) takes any ``cp``: each rank keeps its own queries and the
key/value blocks travel round the ring, the rows cut ``zigzag`` (rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r``
of ``2·cp``) so the causal work is the same on every rank.

:func:`context_parallel` switches a model to one of them for a ``cp`` process group; :func:`split_sequence` cuts
a batch's tokens and positions into this rank's slice (:func:`layout_index`), :func:`gather_sequence` puts the
slices' outputs back in order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ulysses_attention", "ring_attention", "context_parallel", "sequence_layout", "layout_index",
           "split_sequence", "gather_sequence", "gather_tokens", "CP_ATTENTION"]

CP_ATTENTION = ("ulysses", "ring")  # run.cp_attention
_GROUPS: dict[int, object] = {}  # id(model config) → its cp process group
_LAYOUTS: dict[int, str] = {}  # id(model config) → how its sequences are cut (layout_index)


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
        raise ValueError(f"run.cp={cp}: must divide the attention heads ({h}) — Ulysses splits heads over ranks; "
                         "run.cp_attention=ring takes any cp")
    if hk % cp:  # grouped-query attention with fewer kv heads than ranks: repeat them to the query heads
        key, value = (t.repeat_interleave(h // hk, dim=1) for t in (key, value))
    q, k, v = (_a2a(t, group, scatter=1, gather=2) for t in (query, key, value))  # [B, h/cp, S, D]
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    seg = kwargs.get("cp_segments")
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


def ring_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention over the whole sequence from this rank's rows, the keys and values passed round the cp ring
    (:func:`hyperrl.distributed.ring_attention.ring_attention_kernel`; any ``cp``, the rows cut by the
    load-balanced ``zigzag`` layout); returns ``(out [B, n, h, D], None)`` like transformers' SDPA function."""
    from hyperrl.distributed.ring_attention import ring_attention_kernel

    if dropout:
        raise ValueError(f"ring attention: attention dropout ({dropout}) is not supported; the policy's "
                         "attention_dropout must be 0 (it is in every family hyperrl trains)")
    group = _GROUPS[id(module.config)]
    cp = dist.get_world_size(group)
    index = layout_index(query.shape[2] * cp, cp, "zigzag")
    out = ring_attention_kernel(query, key, value, group, index, kwargs.get("cp_segments"), scaling)
    return out.transpose(1, 2).contiguous(), None


def context_parallel(model: torch.nn.Module, group, attention: str = "ulysses") -> torch.nn.Module:
    """Run ``model``'s attention over the cp ``group`` (in place): ``ulysses`` (:func:`ulysses_attention`, rows
    cut contiguously) or ``ring`` (:func:`ring_attention`, rows cut ``zigzag``) — ``run.cp_attention``."""
    from transformers import AttentionInterface

    if attention not in CP_ATTENTION:
        raise ValueError(f"run.cp_attention={attention!r}: one of {', '.join(CP_ATTENTION)}")
    name = f"hyperrl_{attention}"
    AttentionInterface.register(name, ulysses_attention if attention == "ulysses" else ring_attention)
    layout = "contiguous" if attention == "ulysses" else "zigzag"
    configs = [model.config] + [m.config for m in model.modules()  # sub-configs (a VLM's text model) share it
                                if getattr(m, "config", None) is not None and m.config is not model.config]
    for cfg in configs:
        _GROUPS[id(cfg)], _LAYOUTS[id(cfg)] = group, layout
        cfg._attn_implementation = name
    return model


def sequence_layout(model: torch.nn.Module) -> str:
    """How :func:`context_parallel` has ``model``'s sequences cut over the cp ranks: ``contiguous`` (Ulysses) or
    ``zigzag`` (ring)."""
    return _LAYOUTS.get(id(model.config), "contiguous")


def layout_index(total: int, cp: int, layout: str = "contiguous", device=None) -> torch.Tensor:
    """The global positions each cp rank holds, ``[cp, total / cp]``: ``contiguous`` — rank ``r`` the ``r``-th
    slice; ``zigzag`` — the sequence cut into ``2·cp`` chunks, rank ``r`` holding chunks ``r`` and ``2·cp − 1 − r``
    (a causal mask's work then equal on every rank: early chunks see little, late ones much)."""
    if total % (cp * (2 if layout == "zigzag" else 1)):
        raise ValueError(f"layout_index: {total} positions do not cut into {cp} ranks' {layout} slices")
    pos = torch.arange(total, device=device)
    if layout == "contiguous":
        return pos.view(cp, -1)
    if layout != "zigzag":
        raise ValueError(f"layout={layout!r}: contiguous or zigzag")
    chunks = pos.view(2 * cp, -1)
    return torch.cat([chunks[:cp], chunks.flip(0)[:cp]], 1)


def split_sequence(tokens: torch.Tensor, group, pad_id: int = 0, position_ids: torch.Tensor | None = None,
                   layout: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's slice of ``tokens [B, T]``: right-padded with ``pad_id`` to a multiple of ``cp`` (``2·cp``
    for ``zigzag``), cut by :func:`layout_index`; returns ``(tokens [B, T'/cp], position_ids [B, T'/cp], T')`` —
    the slice of ``position_ids [B, T]`` when given (continued past ``T`` on the padding), else the global
    positions. ``zigzag`` (ring attention) refuses a sequence shorter than its ``2·cp`` blocks."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    B, T = tokens.shape
    blocks = cp * (2 if layout == "zigzag" else 1)
    if layout == "zigzag" and T < blocks:
        raise ValueError(f"a sequence of {T} tokens is shorter than ring attention's {blocks} blocks (2 × run.cp="
                         f"{cp}): some rank would hold padding only; lower run.cp or use run.cp_attention=ulysses")
    Tp = -(-T // blocks) * blocks
    padded = torch.nn.functional.pad(tokens, (0, Tp - T), value=pad_id)
    idx = layout_index(Tp, cp, layout, tokens.device)[r]
    if position_ids is None:
        pos = idx.expand(B, -1)
    else:
        tail = position_ids[:, -1:] + torch.arange(1, Tp - T + 1, device=tokens.device)[None]
        pos = torch.cat([position_ids, tail], 1)[:, idx]
    return padded[:, idx], pos, Tp


def gather_sequence(x: torch.Tensor, group, T: int, layout: str = "contiguous") -> torch.Tensor:
    """The slices ``x [B, T'/cp, …]`` of every rank of ``group`` (cut by :func:`layout_index`) put back in
    sequence order along dim 1 and cut to ``T`` (differentiable: the backward hands each rank its slice's
    gradient)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    cp = dist.get_world_size(group)
    if cp == 1:
        return x[:, :T]
    full = wait_tensor(all_gather_single_autograd(x.contiguous(), gather_dim=0, group=group))  # [cp·B, n, …]
    B, n = x.shape[:2]
    seq = torch.cat(full.split(B, dim=0), dim=1)  # rank order: positions layout_index(…).flatten()
    if layout != "contiguous":
        seq = seq.index_select(1, layout_index(cp * n, cp, layout, x.device).flatten().argsort())
    return seq[:, :T]


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """``x [N, …]`` of every rank of ``group`` concatenated along dim 0 in rank order (differentiable: the backward
    hands each rank its rows' gradient, summed over the ranks) — e.g. a mixture's router logits of each rank's
    slice, for a term over all the sequence's tokens."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    return wait_tensor(all_gather_single_autograd(x.contiguous(), gather_dim=0, group=group))
