"""Executors: run a plan on ``torch.distributed`` (gloo on CPU, NCCL/HCCL on devices).

Every process computes the same plan (planning is deterministic) and calls the executor with its
own rank's source shards and destination parameters (``{name: tensor}``; either may be empty).

* :func:`execute_direct` — batched point-to-point per bucket (``batch_isend_irecv``): each rank
  stages at most ``max_bytes`` to send and ``max_bytes`` to receive per bucket; local copies never
  touch the network; fan-out forwards run after the buckets that fill them.
* :func:`execute_full_gather` — the baseline most frameworks use: gather each full tensor onto one
  source rank, send the whole tensor to every destination rank that needs any of it, slice there.
  Also bucketed: at most ``max_bytes`` of full tensors in flight, acknowledged (barrier) before the
  next bucket is released.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyperrl.sharding.layout import DstLayout, Layout
from hyperrl.sharding.plan import Plan
from hyperrl.sharding.spec import boxes

__all__ = ["execute_direct", "execute_full_gather"]


def execute_direct(plan: Plan, rank: int, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], *,
                   max_bytes: int = 128 << 20, group=None) -> dict[str, int]:
    """Apply ``plan`` on this ``rank``; fills ``dst`` in place. Returns byte counters."""
    sent = recvd = copied = 0
    for bucket in plan.buckets(max_bytes):
        ops, pending = [], []
        for t in bucket:
            if t.local and t.src_rank == rank and t.dst_rank == rank:
                source = src[t.tensor] if t.phase == 0 else dst[t.param]
                _view(dst[t.param], t.dst_slice).copy_(_view(source, t.src_slice))  # broadcasts a leading 1
                copied += t.nbytes
                continue
            if t.src_rank == rank:
                source = src[t.tensor] if t.phase == 0 else dst[t.param]
                buf = _view(source, t.src_slice).contiguous()  # a copy only when the slice is strided
                ops.append(dist.P2POp(dist.isend, buf, t.dst_rank, group=group))
                sent += t.nbytes
            if t.dst_rank == rank:
                target = _view(dst[t.param], t.dst_slice)
                if target.is_contiguous():  # receive in place: no staging buffer, no unpacking copy
                    ops.append(dist.P2POp(dist.irecv, target, t.src_rank, group=group))
                else:
                    buf = torch.empty(t.src_slice.sizes, dtype=target.dtype, device=target.device)
                    ops.append(dist.P2POp(dist.irecv, buf, t.src_rank, group=group))
                    pending.append((target, buf))
                recvd += t.nbytes
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for target, buf in pending:
            target.copy_(buf.reshape(target.shape))
    return {"sent": sent, "received": recvd, "local": copied}


def _view(t: torch.Tensor, box) -> torch.Tensor:
    return t[box.slices()]


def execute_full_gather(src_layout: Layout, dst_layout: DstLayout, rank: int, src: dict[str, torch.Tensor],
                        dst: dict[str, torch.Tensor], *, max_bytes: int = 128 << 20, group=None) -> dict[str, int]:
    """Baseline: gather full tensors, send them whole, slice on the destination (see module doc).
    Who reads what comes from the destination's demands (:meth:`DstLayout.demands`, built on the walk the planner
    makes, :meth:`DstLayout.demanded_parts`) — not from a second walk over its parts."""
    demands = dst_layout.demands()
    readers = {n: {dst_layout.params[d.param].mesh.ranks[pc.dst_pos] for d in ds for pc in d.pattern}
               for n, ds in demands.items()}
    names = sorted(readers)
    buckets, cur, size = [], [], 0
    for n in names:
        nb = src_layout[n].nbytes
        if cur and size + nb > max_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += nb
    if cur:
        buckets.append(cur)
    sent = recvd = 0
    for bucket in buckets:
        fulls: dict[str, torch.Tensor] = {}
        # 1) gather every shard onto the tensor's root (its first source rank)
        ops, pending = [], []
        for n in bucket:
            pl = src_layout[n]
            root = pl.mesh.ranks[0]
            bx = boxes(pl.spec, pl.mesh, pl.shape, n)
            owners = {}
            for r, b in bx.items():  # one holder per distinct box
                owners.setdefault(b, r)
            if rank == root:
                fulls[n] = torch.empty(pl.shape, dtype=pl.dtype)
            for b, r in owners.items():
                if b.numel == 0:
                    continue
                if r == rank == root:
                    fulls[n][b.slices()].copy_(src[n])
                elif r == rank:
                    ops.append(dist.P2POp(dist.isend, src[n].contiguous(), root, group=group))
                    sent += src[n].numel() * src[n].element_size()
                elif rank == root:
                    buf = torch.empty(b.sizes, dtype=pl.dtype)
                    ops.append(dist.P2POp(dist.irecv, buf, r, group=group))
                    pending.append((fulls[n][b.slices()], buf))
        _run(ops, pending)
        # 2) send each full tensor to every destination rank reading it
        ops, pending = [], []
        for n in bucket:
            pl = src_layout[n]
            root = pl.mesh.ranks[0]
            for r in sorted(readers[n]):
                if r == root:
                    continue
                if rank == root:
                    ops.append(dist.P2POp(dist.isend, fulls[n], r, group=group))
                    sent += pl.nbytes
                elif rank == r:
                    fulls[n] = torch.empty(pl.shape, dtype=pl.dtype)
                    ops.append(dist.P2POp(dist.irecv, fulls[n], root, group=group))
                    recvd += pl.nbytes
        _run(ops, pending)
        # 3) slice locally, then acknowledge the bucket before the next one is released
        _slice_into(dst_layout, demands, rank, fulls, dst)
        dist.barrier(group=group)
    return {"sent": sent, "received": recvd}


def _run(ops, pending) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for target, buf in pending:
        target.copy_(buf)


def _slice_into(dst_layout: DstLayout, demands, rank: int, fulls: dict[str, torch.Tensor],
                dst: dict[str, torch.Tensor]) -> None:
    """Each demanded piece of this rank's destination params, cut from the full tensors at hand."""
    for name, full in fulls.items():
        for d in demands.get(name, ()):
            p = dst_layout.params[d.param]
            if rank not in p.mesh.ranks:
                continue
            pos = p.mesh.ranks.index(rank)
            for pc in d.pattern:
                if pc.dst_pos != pos:
                    continue
                off = tuple(o + s for o, s in zip(pc.dst_offset, d.shift))
                sizes = (1,) * (len(off) - len(pc.src_box.sizes)) + tuple(pc.src_box.sizes)
                region = tuple(slice(o, o + n) for o, n in zip(off, sizes))
                dst[d.param][region].copy_(full[pc.src_box.slices()])
