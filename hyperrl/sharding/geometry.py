"""The planner's geometry: every intersection of a requested box with the source shards, as arrays.

A source placement's shards along each dim are sorted, contiguous chunk intervals (:class:`SrcGrid`, with the mesh
positions holding each shard); :func:`geometry` intersects a demand pattern's *distinct* boxes with them by a
per-dimension interval sweep (``searchsorted`` over each dim's intervals, vectorised over the boxes — never all-pairs
box tests) and expands the regions to the pattern's pieces by index (:class:`Geometry`). :mod:`hyperrl.sharding.plan`
computes one per (source grid, pattern) and shares it between every group of tensors placed alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperrl.sharding.layout import Placement
from hyperrl.sharding.spec import dim_intervals

__all__ = ["SrcGrid", "src_grid", "Geometry", "geometry"]


@dataclass(frozen=True)
class SrcGrid:
    """Per-dim sorted chunk intervals of one source placement, and the replica table."""

    lo: tuple  # per dim: np.ndarray of interval starts, indexed by the dim-coordinate k
    hi: tuple
    holders: np.ndarray  # [Π n_k, R] source mesh positions holding each k-tuple (row-major)


def src_grid(pl: Placement) -> SrcGrid:
    """``pl``'s shards as per-dim sorted chunk intervals and the mesh positions holding each (every k-tuple of chunk
    indices has the same number of replicas)."""
    mesh, spec = pl.mesh, pl.spec
    ivs = [dim_intervals(L, tuple(mesh.axis_size(a) for a in axes)) for L, axes in zip(pl.shape, spec.dims)]
    # a mesh with no axes (one rank: e.g. a pure-EP expert's sub-mesh) has no coordinates to unravel
    coords = dict(zip(mesh.names, np.unravel_index(np.arange(mesh.size), mesh.shape))) if mesh.names else {}
    flat = np.zeros(mesh.size, np.int64)
    for axes, iv in zip(spec.dims, ivs):
        k = np.zeros(mesh.size, np.int64)
        for a in axes:
            k = k * mesh.axis_size(a) + coords[a]
        flat = flat * len(iv) + k
    order = np.argsort(flat, kind="stable")  # every k-tuple has the same number of replicas
    holders = order.reshape(len(np.unique(flat)), -1)
    return SrcGrid(tuple(np.array([a for a, _ in iv], dtype=np.int64) for iv in ivs),
                    tuple(np.array([b for _, b in iv], dtype=np.int64) for iv in ivs), holders)


class Geometry:
    """Every (piece × overlapping source shard) intersection of one pattern, as arrays ``[E]`` / ``[E, nd]``. The
    distinct regions (source shard ∩ requested box) are computed once; the per-entry boxes (``src_lo``,
    ``inter_lo``, ``size``: the materialisation's) are gathered from them on first use — planning and its byte
    accounting read only ``piece``, ``holders``, ``sender``, ``key`` and ``numel``."""

    def __init__(self, piece, ent, r_src_lo, r_lo, r_size, holders, sender, key, numel):
        self.piece = piece  # [E] index into the pattern
        self._ent, self._r = ent, (r_src_lo, r_lo, r_size)  # [E] → region row; the regions' boxes
        self.holders = holders  # [E, R] source mesh positions
        self.sender = sender  # [E] holder chosen to send (replicas rotate with the piece index)
        self.key = key  # [E] region id: equal for replicas requesting the same region
        self.numel = numel  # [E]

    @property
    def src_lo(self) -> np.ndarray:  # [E, nd] the holders' shard box start
        return self._r[0][self._ent]

    @property
    def inter_lo(self) -> np.ndarray:  # [E, nd] intersection (global coords of the source tensor)
        return self._r[1][self._ent]

    @property
    def size(self) -> np.ndarray:  # [E, nd]
        return self._r[2][self._ent]


def geometry(grid: SrcGrid, pattern) -> Geometry:
    """Intersect each *distinct* requested box with the source shards once (destination replicas
    request the same boxes: 256 pieces of a replicated norm are one box), then expand to the
    pieces by index — every per-entry array is one gather."""
    nd = len(grid.lo)
    box_ids: dict = {}
    box_of_piece = np.array([box_ids.setdefault(p.src_box, len(box_ids)) for p in pattern], np.int64)
    U = len(box_ids)
    plo = np.array([b.offsets for b in box_ids], dtype=np.int64).reshape(U, nd)
    phi = plo + np.array([b.sizes for b in box_ids], dtype=np.int64).reshape(U, nd)
    # per dim, the k range overlapping [plo, phi): from the first interval ending after plo to the
    # first interval starting at or after phi (intervals are sorted and contiguous)
    k0 = np.zeros((U, nd), np.int64)
    k1 = np.zeros((U, nd), np.int64)
    for d in range(nd):
        k0[:, d] = np.searchsorted(grid.hi[d], plo[:, d], side="right")
        k1[:, d] = np.searchsorted(grid.lo[d], phi[:, d], side="left")
    cnt = np.maximum(k1 - k0, 0)
    n_per = np.where((phi > plo).all(1), cnt.prod(1), 0)
    box = np.repeat(np.arange(U), n_per)  # the distinct (box, source shard) regions
    j = np.arange(box.size) - np.repeat(np.cumsum(n_per) - n_per, n_per)
    ks = np.zeros((box.size, nd), np.int64)
    for d in range(nd - 1, -1, -1):
        c = cnt[box, d]
        ks[:, d] = k0[box, d] + j % c
        j = j // c
    src_lo = np.zeros((box.size, nd), np.int64)
    src_hi = np.zeros((box.size, nd), np.int64)
    for d in range(nd):
        src_lo[:, d], src_hi[:, d] = grid.lo[d][ks[:, d]], grid.hi[d][ks[:, d]]
    lo = np.maximum(src_lo, plo[box])
    size = np.minimum(src_hi, phi[box]) - lo
    keep = (size > 0).all(1)
    box, ks, src_lo, lo, size = box[keep], ks[keep], src_lo[keep], lo[keep], size[keep]
    flat_k = np.ravel_multi_index(tuple(ks.T), [len(a) for a in grid.lo]) if nd else np.zeros(box.size, np.int64)
    # region id: the rank of (source shard, box) — replicas requesting the same box share it
    region = np.empty(box.size, np.int64)
    region[np.lexsort((box, flat_k))] = np.arange(box.size)
    # expand: piece i takes the regions of its box, in order
    first = np.searchsorted(box, np.arange(U))  # box is sorted: its regions are contiguous
    per_box = np.bincount(box, minlength=U)
    n_piece = per_box[box_of_piece]
    # the per-entry index arrays in int32 (E ≤ 2³¹; half the memory of a 262,144-entry geometry to touch)
    piece = np.repeat(np.arange(len(pattern), dtype=np.int32), n_piece)
    ent = np.repeat((first[box_of_piece] - (np.cumsum(n_piece) - n_piece)).astype(np.int32), n_piece)
    ent += np.arange(piece.size, dtype=np.int32)
    R = grid.holders.shape[1]
    r_holders = grid.holders[flat_k].astype(np.int32)
    holders = r_holders[ent]
    sender = holders[:, 0] if R == 1 else holders[np.arange(piece.size), piece % R]
    return Geometry(piece, ent, src_lo, lo, size, holders, sender, region.astype(np.int32)[ent], size.prod(1)[ent])
