"""``verify(plan)``: an independent coverage proof of a plan, from its transfers alone.

Checks, without using the planner's intersection code: every slice lies inside the sender's and
the receiver's local buffers; no two received boxes of one destination (rank, param) overlap;
their volumes add up to the local size minus padding; forwards only send data their sender has
received; and, by name, every (destination rank, parameter, source tensor) that needs data gets
some — the error reads like ``layers.3.mlp.experts.17.up_proj.weight: no source for param
… on rank 12``.
"""

from __future__ import annotations

from collections import defaultdict

from hyperrl.errors import HyperRLError
from hyperrl.sharding.layout import DstLayout, Layout
from hyperrl.sharding.plan import Plan
from hyperrl.sharding.spec import Box, boxes

__all__ = ["verify", "PlanError"]


class PlanError(HyperRLError, ValueError):
    """A plan that does not deliver every destination element exactly once."""


def _inside(inner: Box, shape: tuple[int, ...]) -> bool:
    return len(inner.sizes) == len(shape) and all(
        0 <= o and o + s <= n for o, s, n in zip(inner.offsets, inner.sizes, shape))


def _overlaps(bs: list[Box]) -> tuple[Box, Box] | None:
    """Sweep along dim 0 (sorted starts); pairwise only among boxes whose dim-0 spans overlap."""
    bs = sorted(bs, key=lambda b: b.offsets)
    active: list[Box] = []
    for b in bs:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > b.offsets[0]]
        for a in active:
            if a.intersect(b) is not None:
                return a, b
        active.append(b)
    return None


def _needs(dst: DstLayout):
    """(rank, param) → (local shape, padding-free volume, {source tensors that must contribute})."""
    out = {}
    for name, p in dst.params.items():
        for pos, (_, c) in enumerate(p.mesh.coords()):
            rank = p.mesh.ranks[pos]
            vol, srcs = 0, set()
            for part in p.parts:
                rb = part.rule.box(part.shape, p.mesh, c)
                for blk in part.blocks:
                    inter = rb.intersect(blk.virtual_box())
                    if inter is not None:
                        vol += inter.numel
                        srcs.add(blk.src)
            out[(rank, name)] = (p.local_shape(pos), vol, srcs)
    return out


def verify(plan: Plan) -> None:
    """Raise :class:`PlanError` describing the first violation; return None when the plan is exact."""
    src: Layout = plan.src
    dst: DstLayout = plan.dst
    needs = _needs(dst)
    src_boxes = {name: boxes(pl.spec, pl.mesh, pl.shape, name) for name, pl in src.items()}
    received: dict = defaultdict(list)
    got_from: dict = defaultdict(set)
    arrived: dict = defaultdict(list)
    forwards = []
    for t in plan:
        key = (t.dst_rank, t.param)
        if key not in needs:
            raise PlanError(f"{t.param}: rank {t.dst_rank} holds no such destination parameter ({t})")
        shape = needs[key][0]
        if not _inside(t.dst_slice, shape):
            raise PlanError(f"{t.param}: destination slice {t.dst_slice} outside local shape {list(shape)} ({t})")
        if t.phase == 0:
            held = src_boxes[t.tensor].get(t.src_rank)
            if held is None or not _inside(t.src_slice, held.sizes):
                raise PlanError(f"{t.tensor}: rank {t.src_rank} does not hold source slice {t.src_slice} ({t})")
        else:
            forwards.append(t)
        if t.nbytes != t.dst_slice.numel * src[t.tensor].itemsize:
            raise PlanError(f"{t.tensor}: {t.nbytes} bytes for {t.dst_slice.numel} elements ({t})")
        received[key].append(t.dst_slice)
        arrived[key].append((t.dst_slice, t.phase))
        got_from[key].add(t.tensor)
    for t in forwards:  # a forward sends what its sender received in an earlier phase
        have = [b for b, ph in arrived[(t.src_rank, t.param)]
                if ph < t.phase and b.intersect(t.src_slice) == t.src_slice]
        if not have:
            raise PlanError(f"{t.param}: rank {t.src_rank} forwards {t.src_slice} in phase {t.phase} before it "
                            f"received it ({t})")
    for key, (_shape, vol, srcs) in needs.items():
        rank, param = key
        missing = sorted(srcs - got_from.get(key, set()))
        if missing:
            raise PlanError(f"{missing[0]}: no source for param {param} on rank {rank}"
                            + (f" (and {len(missing) - 1} more tensors)" if len(missing) > 1 else ""))
        bs = received.get(key, [])
        pair = _overlaps(bs)
        if pair:
            raise PlanError(f"{param} on rank {rank}: received boxes {pair[0]} and {pair[1]} overlap")
        total = sum(b.numel for b in bs)
        if total != vol:
            raise PlanError(f"{param} on rank {rank}: received {total} elements, needs {vol}")
