"""In-process plan execution and the expected destination state, for tests and notebooks.

``simulate(plan, full)`` cuts each source rank's shard out of the full tensors, runs every
transfer as a tensor copy (phase 0, then forwards), and returns ``{rank: {param: tensor}}``.
``expected_destination(dst, full)`` builds the same from the destination layout's *definition*
(virtual tensors, rules, local concatenation) without the planner — so comparing the two is an
element-level check of the plan.
"""

from __future__ import annotations

import torch

from hyperrl.sharding.layout import DstLayout, Layout
from hyperrl.sharding.plan import Plan
from hyperrl.sharding.spec import boxes

__all__ = ["simulate", "expected_destination", "source_shards", "random_state"]


def random_state(layout: Layout, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full tensors with distinct values (element labels) for every source tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, pl in layout.items():
        n = 1
        for s in pl.shape:
            n *= s
        vals = torch.randperm(max(n, 1), generator=g)[:n].to(torch.float64) + 1.0  # distinct, never 0
        out[name] = vals.reshape(pl.shape).to(pl.dtype) if pl.dtype.is_floating_point else vals.reshape(pl.shape)
    return out


def source_shards(layout: Layout, full: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Each source rank's local shards of the ``full`` tensors under ``layout`` (rank → name → tensor)."""
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for name, pl in layout.items():
        for rank, box in boxes(pl.spec, pl.mesh, pl.shape, name).items():
            shards.setdefault(rank, {})[name] = full[name][box.slices()].clone()
    return shards


def _alloc(dst: DstLayout) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, p in dst.params.items():
        for pos, rank in enumerate(p.mesh.ranks):
            out.setdefault(rank, {})[name] = torch.zeros(p.local_shape(pos), dtype=p.dtype)
    return out


def simulate(plan: Plan, full: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan`` on one process: cut each source rank's shards from the ``full`` tensors, apply every transfer
    in phase order, and return each destination rank's parameters — what the executors must produce."""
    shards = source_shards(plan.src, full)
    out = _alloc(plan.dst)
    ts = sorted(plan, key=lambda t: t.phase)
    for t in ts:
        if t.phase == 0:
            piece = shards[t.src_rank][t.tensor][t.src_slice.slices()]
        else:
            piece = out[t.src_rank][t.param][t.src_slice.slices()]
        dst = out[t.dst_rank][t.param][t.dst_slice.slices()]
        dst.copy_(piece.reshape(dst.shape))
    return out


def expected_destination(dst: DstLayout, full: dict[str, torch.Tensor],
                         ranks=None) -> dict[int, dict[str, torch.Tensor]]:
    """``{rank: {param: local tensor}}`` from the layout's definition (``ranks``: only these)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, p in dst.params.items():
        if ranks is not None and not set(ranks) & set(p.mesh.ranks):
            continue
        virtuals = []
        for part in p.parts:
            v = torch.zeros(part.shape, dtype=p.dtype)
            for b in part.blocks:
                if b.window:  # the part is a window of its source
                    v.copy_(full[b.src].reshape(b.shape)[tuple(slice(-o, -o + n)
                                                               for o, n in zip(b.offset, part.shape))])
                    continue
                region = v[b.virtual_box().slices()]
                region.copy_(full[b.src].reshape(region.shape))
            virtuals.append(v)
        for pos, (_, c) in enumerate(p.mesh.coords()):
            if ranks is not None and p.mesh.ranks[pos] not in ranks:
                continue
            pieces = [v[part.rule.box(part.shape, p.mesh, c).slices()] for v, part in zip(virtuals, p.parts)]
            local = torch.cat(pieces, dim=p.cat_dim) if len(pieces) > 1 else pieces[0]
            out.setdefault(p.mesh.ranks[pos], {})[name] = local
    return out
