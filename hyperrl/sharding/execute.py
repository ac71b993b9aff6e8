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

from .layout import DstLayout, Layout
from .plan import Plan
from .spec import boxes

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
                _view(dst[t.param], t.dst_slice).copy_(_view(source, t.src_slice).reshape(t.dst_slice.sizes))
                copied += t.nbytes
                continue
            if t.src_rank == rank:
                source = src[t.tensor] if t.phase == 0 else dst[t.param]
                buf = _view(source, t.src_slice).contiguous()
                ops.append(dist.P2POp(dist.isend, buf, t.dst_rank, group=group))
                sent += t.nbytes
            if t.dst_rank == rank:
                target = _view(dst[t.param], t.dst_slice)
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
    """Baseline: gather full tensors, send them whole, slice on the destination (see module doc)."""
    readers: dict[str, set[int]] = {}
    for p in dst_layout.params.values():
        for pos, (_, c) in enumerate(p.mesh.coords()):
            for part in p.parts:
                rb = part.rule.box(part.shape, p.mesh, c)
                for b in part.blocks:
                    if rb.intersect(b.virtual_box()) is not None:
                        readers.setdefault(b.src, set()).add(p.mesh.ranks[pos])
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
        _slice_into(dst_layout, rank, fulls, dst)
        dist.barrier(group=group)
    return {"sent": sent, "received": recvd}


def _run(ops, pending) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for target, buf in pending:
        target.copy_(buf)


def _slice_into(dst_layout: DstLayout, rank: int, fulls: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]):
    for pname, p in dst_layout.params.items():
        if rank not in p.mesh.ranks:
            continue
        pos = p.mesh.ranks.index(rank)
        c = dict(list(p.mesh.coords())[pos][1])
        for j, part in enumerate(p.parts):
            rb = part.rule.box(part.shape, p.mesh, c)
            off = p.cat_offset(pos, j) if len(p.parts) > 1 else 0
            for b in part.blocks:
                if b.src not in fulls:
                    continue
                inter = rb.intersect(b.virtual_box())
                if inter is None:
                    continue
                local = list(inter.relative_to(rb).offsets)
                if len(p.parts) > 1:
                    local[p.cat_dim] += off
                src_box = inter.relative_to(b.virtual_box())
                piece = fulls[b.src]
                if b.stacked:
                    piece = piece.unsqueeze(0)
                region = tuple(slice(o, o + s) for o, s in zip(local, inter.sizes))
                dst[pname][region].copy_(piece[src_box.slices()])
