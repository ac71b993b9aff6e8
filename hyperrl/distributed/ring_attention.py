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

On the CPU each step runs torch's flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which returns the
log-sum-exp the merge needs) per pair of position runs — whole, causal or skipped — and its backward with the merged
output; packed segments and other devices take a masked matmul path. Grouped-query attention is computed per
key/value head (queries viewed ``[B, h_kv, h/h_kv, n, D]``; a causal pair repeats the key/value heads). Computed in
fp32 (fp64 inputs in fp64); the output is cast to the queries' dtype. Which global
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
_FLASH = True  # on the CPU, torch's flash kernel per pair of position runs (tests turn it off for the matmul path)


def _shift(buf: torch.Tensor, group, cp: int, r: int):
    """Send ``buf`` to the next rank of the ring and receive the previous rank's (asynchronous): returns
    ``(received, works)``."""
    nxt, prv = dist.get_global_rank(group, (r + 1) % cp), dist.get_global_rank(group, (r - 1) % cp)
    recv = torch.empty_like(buf)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)])
    return recv, works


def _ring(kv: torch.Tensor, group, cp: int, r: int, f):
    """Each key/value block as it reaches this rank, ``(owner, k, v)`` in dtype ``f`` — rank ``(r − s) mod cp``'s at
    step ``s`` — the next block already on its way while the caller folds this one."""
    for s in range(cp):
        nxt = _shift(kv, group, cp, r) if s < cp - 1 else None
        kf, vf = kv.to(f).unbind(0)
        yield (r - s) % cp, kf, vf
        if nxt is not None:
            kv, works = nxt
            for w in works:
                w.wait()


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


def _merge(o, lse, ob, lse_b) -> None:
    """``o, lse ←`` the log-sum-exp merge with one block's ``ob, lse_b`` (in place; −∞ where a query saw nothing)."""
    new = torch.logaddexp(lse, lse_b)
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    o.mul_(torch.exp(lse - ref)[..., None]).add_(ob * torch.exp(lse_b - ref)[..., None])
    lse.copy_(new)


def _fold(o, lse, q, k, v, mask, scale):
    """Fold one key/value block into the running output ``o [B, hk, g, m, D]`` and ``lse [B, hk, g, m]``
    (in place)."""
    s = _scores(q, k, mask, scale)
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # a query that sees none of the block
    p = torch.exp(s - mx)
    total = p.sum(-1, keepdim=True)
    ob = torch.matmul(p, v[:, :, None]) / total.clamp_min(torch.finfo(total.dtype).tiny)
    _merge(o, lse, ob, (torch.log(total) + mx)[..., 0])


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of consecutive positions in ``idx`` (zigzag: a rank's two chunks, or one)."""
    cuts = [i for i in range(1, len(idx)) if idx[i] != idx[i - 1] + 1]
    return list(zip([0, *cuts], [*cuts, len(idx)]))


def _pairs(iq: list[int], ik: list[int]):
    """The visible pairs ``(a, b, c, d, causal)`` of query run ``a:b`` and key run ``c:d``: every key at or before
    every query (``causal`` False), or the same positions (``causal`` True); None when a pair is only partly
    visible (a layout the flash path does not cut: the masked path takes it)."""
    out = []
    for a, b in _runs(iq):
        for c, d in _runs(ik):
            if iq[b - 1] < ik[c]:
                continue  # every key after every query
            if iq[a] >= ik[d - 1]:
                out.append((a, b, c, d, False))
            elif (iq[a], iq[b - 1]) == (ik[c], ik[d - 1]):
                out.append((a, b, c, d, True))
            else:
                return None
    return out


def _grouped(q, hk):
    """``[B, h, m, D] → [B, hk, g·m, D]``: each key/value head's query heads as one longer sequence (no mask: the
    rows are independent)."""
    B, h, m, D = q.shape
    return q.reshape(B, hk, (h // hk) * m, D)


def _flash_fold(o, lse, q, k, v, pairs, scale) -> None:
    """Fold one block by torch's CPU flash kernel, a pair of runs at a time (``o [B, h, n, D]``, ``lse [B, h, n]``;
    ``k, v [B, hk, n, D]``): a causal pair with the key/value heads repeated to the query heads, a full pair with
    the query heads of each key/value head as one sequence."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, h, _, D = q.shape
    hk = k.shape[1]
    for a, b, c, d, causal in pairs:
        qs, ks, vs = q[:, :, a:b].contiguous(), k[:, :, c:d].contiguous(), v[:, :, c:d].contiguous()
        if causal:
            ks, vs = (t.repeat_interleave(h // hk, 1) for t in (ks, vs))
            ob, lb = flash(qs, ks, vs, 0.0, True, scale=scale)
        else:
            ob, lb = flash(_grouped(qs, hk), ks, vs, 0.0, False, scale=scale)
            ob, lb = ob.reshape(B, h, b - a, D), lb.reshape(B, h, b - a)
        _merge(o[:, :, a:b], lse[:, :, a:b], ob, lb.to(lse.dtype))


def _flash_unfold(dq, dk, dv, q, k, v, do, o, lse, pairs, scale) -> None:
    """One block's gradients by the flash kernel's backward, given the *merged* output and log-sum-exp (so each
    pair's share is exact): accumulated into ``dq [B, h, n, D]``, ``dk, dv [B, hk, n, D]``."""
    back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    B, h, _, D = q.shape
    hk = k.shape[1]
    for a, b, c, d, causal in pairs:
        qs, dos, os_ = (t[:, :, a:b].contiguous() for t in (q, do, o))
        ls = lse[:, :, a:b].contiguous()
        ks, vs = k[:, :, c:d].contiguous(), v[:, :, c:d].contiguous()
        if causal:
            g = h // hk
            gq, gk, gv = back(dos, qs, ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1), os_, ls, 0.0, True,
                              scale=scale)
            gk, gv = (t.reshape(B, hk, g, d - c, D).sum(2) for t in (gk, gv))
        else:
            m = (h // hk) * (b - a)
            gq, gk, gv = back(_grouped(dos, hk), _grouped(qs, hk), ks, vs, _grouped(os_, hk), ls.reshape(B, hk, m), 0.0,
                              False, scale=scale)
            gq = gq.reshape(B, h, b - a, D)
        dq[:, :, a:b] += gq
        dk[:, :, c:d] += gk
        dv[:, :, c:d] += gv


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
        flash = _flash_pairs(q, index, segments, r)
        for owner, kf, vf in _ring(torch.stack([k, v]).contiguous(), group, cp, r, f):
            if flash[owner] is not None:
                _flash_fold(o.view(B, h, n, D), lse.view(B, h, n), qf.view(B, h, n, D), kf, vf, flash[owner], scale)
            else:
                for a, b, mask in _blocks(index, segments, r, owner, n):
                    _fold(o[..., a:b, :], lse[..., a:b], qf[..., a:b, :], kf, vf, mask, scale)
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
        flash = _flash_pairs(q, index, segments, r)
        for owner, kf, vf in _ring(kv, group, cp, r, f):
            if flash[owner] is not None:
                _flash_unfold(dq.view(B, h, n, D), dkv[0], dkv[1], qf.view(B, h, n, D), kf, vf, do.view(B, h, n, D),
                              o.view(B, h, n, D), lse.view(B, h, n), flash[owner], scale)
            else:
                for a, b, mask in _blocks(index, segments, r, owner, n):
                    _unfold(dq[..., a:b, :], dkv[0], dkv[1], qf[..., a:b, :], kf, vf, do[..., a:b, :],
                            lse[..., a:b], delta[..., a:b], mask, scale)
            dkv, works = _shift(dkv, group, cp, r)  # the block's gradients travel with it; home after cp shifts
            for w in works:
                w.wait()
        return dq.reshape(B, h, n, D).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _flash_pairs(q, index, segments, r: int) -> list:
    """Per owner rank, the run pairs :func:`_flash_fold` computes for rank ``r``'s queries — or None for the masked
    matmul path (not on the CPU, packed segments, a layout with partly visible pairs, a torch without the kernel, or
    ``_FLASH`` off)."""
    kernel = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
    if not (_FLASH and kernel) or q.device.type != "cpu" or segments is not None:
        return [None] * len(index)
    rows = index.tolist()
    return [_pairs(rows[r], ik) for ik in rows]


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
