"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the load-balanced causal
split of Megatron-LM's context parallelism and Llama 3's): each of the ``cp`` ranks of a group holds the
queries, keys and values of its own rows of every sequence; the key/value blocks travel round the ring —
at step ``s`` rank ``r`` holds rank ``(r − s) mod cp``'s — and each rank folds every block into its
queries' output with the log-sum-exp merge of blockwise (flash) attention. No rank ever holds another's
queries or the whole sequence's keys; the number of ranks is not bounded by the heads (Ulysses' limit).

Math, for this rank's queries ``q [B, h, n, D]`` and one block ``k, v [B, h_kv, n, D]``, ``scale = 1/√D``::

    s = q kᵀ · scale  (−∞ where key position > query position, or another packed segment)
    lse_b = log Σ_j exp s_j          o_b = Σ_j softmax(s)_j v_j
    lse ← log(e^lse + e^lse_b)       o ← o · e^(lse_old − lse) + o_b · e^(lse_b − lse)

Backward (the same ring; the blocks' gradients travel with them and arrive home after ``cp`` shifts)::

    p = exp(s − lse)   Δ = Σ_d dO·O   dV += pᵀ dO   dS = p ⊙ (dO vᵀ − Δ)
    dQ += dS k · scale   dK += dSᵀ q · scale

Grouped-query attention is computed per key/value head (queries viewed ``[B, h_kv, h/h_kv, n, D]``), never
repeated. Computed in fp32 (fp64 inputs in fp64); the output is cast to the queries' dtype. Which global
positions each rank holds is the caller's ``index [cp, n]``
(:func:`hyperrl.distributed.context_parallel.layout_index`; the causal mask is built from it). Written here
because torch ships ring attention only for its own ``DTensor`` SDPA
(``torch.distributed.tensor.experimental.context_parallel``), not as a function of a Hugging Face model's local
q/k/v.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_attention_kernel"]

_ROWS = 1024  # query rows per block product: the scores of one product are [B, h, _ROWS, n] fp32


def _shift(buf: torch.Tensor, group, cp: int, r: int):
    """Send ``buf`` to the next rank of the ring and receive the previous rank's (asynchronous): returns
    ``(received, works)``."""
    nxt, prv = dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp)
    recv = torch.empty_like(buf)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)])
    return recv, works


def _visible(iq: torch.Tensor, ik: torch.Tensor, seg_q, seg_k) -> torch.Tensor:
    """Which keys each query sees: ``[B or 1, m, c]`` — causal by global position, within one packed segment."""
    mask = (iq[:, None] >= ik[None, :])[None]
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, hk, g, m, D]``, ``k [B, hk, c, D]`` → masked scores ``[B, hk, g, m, c]``."""
    s = torch.matmul(q, k[:, :, None].transpose(-1, -2)) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


def _fold(o, lse, q, k, v, mask, scale):
    """Fold one key/value block into the running output ``o [B, hk, g, m, D]`` and ``lse [B, hk, g, m]``
    (in place)."""
    s = _scores(q, k, mask, scale)
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # a query that sees none of the block
    p = torch.exp(s - mx)
    total = p.sum(-1, keepdim=True)
    ob = torch.matmul(p, v[:, :, None]) / total.clamp_min(torch.finfo(total.dtype).tiny)
    lse_b = (torch.log(total) + mx)[..., 0]
    new = torch.logaddexp(lse, lse_b)
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    o.mul_(torch.exp(lse - ref)[..., None]).add_(ob * torch.exp(lse_b - ref)[..., None])
    lse.copy_(new)


def _unfold(dq, dk, dv, q, k, v, do, lse, delta, mask, scale):
    """One block's share of the gradients (accumulated in place): ``dq [B, hk, g, m, D]``, ``dk, dv [B, hk, c,
    D]``."""
    p = torch.exp(_scores(q, k, mask, scale) - lse[..., None])
    dv.add_(torch.matmul(p.transpose(-1, -2), do).sum(2))
    ds = p * (torch.matmul(do, v[:, :, None].transpose(-1, -2)) - delta[..., None])
    dq.add_(torch.matmul(ds, k[:, :, None]) * scale)
    dk.add_(torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, index, segments, scale):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        B, h, n, D = q.shape
        hk = k.shape[1]
        f = torch.promote_types(q.dtype, torch.float32)
        qf = q.to(f).reshape(B, hk, h // hk, n, D)
        o = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=f, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for s in range(cp):
            owner = (r - s) % cp
            if s < cp - 1:
                nxt, works = _shift(kv, group, cp, r)
            kf, vf = kv.to(f).unbind(0)
            for a, b, mask in _blocks(index, segments, r, owner, n):
                _fold(o[..., a:b, :], lse[..., a:b], qf[..., a:b, :], kf, vf, mask, scale)
            if s < cp - 1:
                for w in works:
                    w.wait()
                kv = nxt
        ctx.save_for_backward(q, k, v, o, lse, index, *(() if segments is None else (segments,)))
        ctx.group, ctx.scale = group, scale
        return o.reshape(B, h, n, D).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse, index, *seg = ctx.saved_tensors
        segments = seg[0] if seg else None
        group, scale = ctx.group, ctx.scale
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        B, h, n, D = q.shape
        hk = k.shape[1]
        f = torch.promote_types(q.dtype, torch.float32)
        qf = q.to(f).reshape(B, hk, h // hk, n, D)
        do = dout.to(f).reshape(qf.shape)
        delta = (do * o).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=f, device=q.device)
        for s in range(cp):
            owner = (r - s) % cp
            if s < cp - 1:
                nxt, works = _shift(kv, group, cp, r)
            kf, vf = kv.to(f).unbind(0)
            for a, b, mask in _blocks(index, segments, r, owner, n):
                _unfold(dq[..., a:b, :], dkv[0], dkv[1], qf[..., a:b, :], kf, vf, do[..., a:b, :], lse[..., a:b],
                        delta[..., a:b], mask, scale)
            if s < cp - 1:
                for w in works:
                    w.wait()
                kv = nxt
            dkv, works = _shift(dkv, group, cp, r)  # the block's gradients travel with it; home after cp shifts
            for w in works:
                w.wait()
        return dq.reshape(B, h, n, D).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _blocks(index, segments, r, owner, n):
    """``(a, b, mask)`` for this rank's query rows ``a:b`` (``_ROWS`` at a time) against ``owner``'s keys, skipping
    row ranges that see none of them (``mask [B or 1, b − a, n]``: which keys each query sees)."""
    iq, ik = index[r], index[owner]
    for a in range(0, n, _ROWS):
        b = min(a + _ROWS, n)
        if int(iq[a:b].max()) < int(ik.min()):
            continue  # every key of the block lies after these queries
        sq, sk = (None, None) if segments is None else (segments[:, iq[a:b]], segments[:, ik])
        mask = _visible(iq[a:b], ik, sq, sk)
        if mask.any():
            yield a, b, mask


def ring_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, index: torch.Tensor,
                          segments: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, the keys and values exchanged round the
    ring of ``group`` (see the module doc). ``q [B, h, n, D]``, ``k, v [B, h_kv, n, D]`` (``h_kv`` divides
    ``h``): this rank's rows, at the global positions ``index[rank]`` (``index [cp, n]``: every rank's);
    ``segments [B, cp·n]``: packed sequences' ids by global position (attention within a segment), or None.
    Returns ``[B, h, n, D]`` in ``q``'s dtype; differentiable (the backward is a second ring pass)."""
    cp = dist.get_world_size(group)
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"ring attention: q {tuple(q.shape)} and k, v {tuple(k.shape)} must be [B, h, n, D] "
                         "and [B, h_kv, n, D]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: the key/value heads ({k.shape[1]}) must divide the query heads "
                         f"({q.shape[1]})")
    if tuple(index.shape) != (cp, q.shape[2]):
        raise ValueError(f"ring attention: index {tuple(index.shape)} must be [cp, n] = [{cp}, {q.shape[2]}]")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Ring.apply(q, k, v, group, index.to(q.device), None if segments is None else segments.to(q.device),
                       scale)
