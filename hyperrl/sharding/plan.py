"""The direct-reshard planner: exactly the intersections of source and destination shards.

``reshard_plan(src, dst)`` returns a :class:`Plan` — plain data in a deterministic order. For
every source tensor and every destination piece that reads it, the planner intersects the piece
with the source shards by a per-dimension interval sweep (:mod:`hyperrl.sharding.geometry`: ``searchsorted`` over each
dim's sorted chunk intervals, vectorised over the pieces — never all-pairs box tests) and memoises the
result by the signature (shape, spec, mesh shape, demand pattern), so identically placed
tensors — the 44,544 routed experts of DeepSeek-V3 — are planned once and shared. A plan is a
list of *groups*: one geometry, one source rank map, one destination rank map and the tensors
that share them; transfers are materialised lazily (``iter(plan)``), statistics per group. Each demand is filed into
its group as the destination layout makes it (:meth:`DstLayout.demanded_parts`: no Demand objects; each checked
against its source there, :func:`check_compatible`'s error on a mismatch), and the plan's order is that of a walk
over the source tensors by name.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hyperrl.sharding.buckets import bucketize
from hyperrl.sharding.geometry import Geometry, geometry, src_grid
from hyperrl.sharding.layout import Demand, DstLayout, Layout, Placement, check_compatible
from hyperrl.sharding.report import PlanStats, _sum_by, plan_stats, plan_str, plan_traffic
from hyperrl.sharding.spec import Box
from hyperrl.sharding.transfer import Transfer

__all__ = ["Transfer", "Plan", "PlanStats", "reshard_plan"]


class _Classes(NamedTuple):
    """A fan-out group's entries by how trees treat them (:meth:`_Group._classes`)."""

    source: np.ndarray  # bool: a source-side class (the root's sender) or a destination-side one
    rank: np.ndarray  # the physical rank that sends
    c: np.ndarray  # requesters of the region
    v: np.ndarray  # rotation base: node (v + t) mod c in tree t
    w: np.ndarray  # the class's bytes (one member)


class _Tree(NamedTuple):
    """Per entry of a group's geometry: received from the source (``is_leader``) or forwarded by
    the destination of ``parent`` (a piece index) in ``phase``; ``sender`` the physical rank."""

    is_leader: np.ndarray
    parent: np.ndarray
    phase: np.ndarray
    sender: np.ndarray


@dataclass
class _Group:
    geo: Geometry
    pattern: tuple
    tensor_nbytes: int
    itemsize: int
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    fan_out: bool
    # the members, as parallel lists — tensor names, destination params and shifts (their Demands' fields; the pattern
    # is the group's): 45,000 Demand and (tensor, Demand) tuples were as many objects to make and for the collector to
    # walk after a DeepSeek-V3 plan
    tensors: list = field(default_factory=list)
    params: list = field(default_factory=list)
    shifts: list = field(default_factory=list)
    offsets: list = field(default_factory=list)  # the tree of each member (fan-out; empty: tree 0 for all)
    ranks_per_node: int = 0  # > 0: among source replicas, prefer one on the receiver's node
    # arrays equal for every group of one geometry, source and destination meshes (planning shares them: the 16
    # expert-parallel source meshes of DeepSeek-V3 make groups that differ in their source ranks only)
    shared: dict | None = field(default=None, repr=False)

    def __post_init__(self):
        g = self.geo
        src_r = np.asarray(self.src_ranks, np.int64)
        key = (id(g), self.dst_ranks)
        hit = self.shared.get(key) if self.shared is not None else None
        if hit is None:
            dst_r = np.asarray(self.dst_ranks, np.int64)
            dst_pos = np.array([p.dst_pos for p in self.pattern], np.int64)
            hit = (dst_r, dst_pos, dst_r[dst_pos[g.piece]])
            if self.shared is not None:
                self.shared[key] = hit
        dst_r, dst_pos, self.dst_rank = hit
        if set(self.src_ranks).isdisjoint(self.dst_ranks):  # trainer and rollout on other ranks: nothing local
            self.is_local = np.zeros(g.piece.size, bool)
        else:
            self.is_local = (src_r[g.holders] == self.dst_rank[:, None]).any(1)
        self._src_r, self._dst_r, self._dst_pos = src_r, dst_r, dst_pos
        self._src_sender = src_r[g.sender]
        if self.ranks_per_node and g.holders.shape[1] > 1 and g.piece.size:
            # replicas on the receiver's node first (stable), rotating among them with the piece
            held = src_r[g.holders]
            near = (held // self.ranks_per_node) == (self.dst_rank // self.ranks_per_node)[:, None]
            n_near = near.sum(1)
            order = np.argsort(~near, axis=1, kind="stable")
            pick = np.where(n_near > 0, g.piece % np.maximum(n_near, 1), g.piece % held.shape[1])
            self._src_sender = held[np.arange(held.shape[0]), order[np.arange(held.shape[0]), pick]]
        self._trees: dict[int, _Tree] = {}
        self._cls: _Classes | None = None
        E = g.piece.size
        if self.fan_out and E:  # the region index of each entry, and each region's requesters in piece order
            first = np.lexsort((g.piece, g.key))
            key_sorted = g.key[first]
            self._starts = np.flatnonzero(np.r_[True, key_sorted[1:] != key_sorted[:-1]])
            self._counts = np.diff(np.r_[self._starts, E])
            self._j = np.empty(E, np.int64)
            self._j[first] = np.arange(E) - np.repeat(self._starts, self._counts)
            self._c = np.empty(E, np.int64)
            self._c[first] = np.repeat(self._counts, self._counts)
            self._first = first
            self._start = np.empty(E, np.int64)
            self._start[first] = np.repeat(self._starts, self._counts)
        self.rotations = int(self._counts.max()) if self.fan_out and E else 1

    def tree(self, member: int) -> _Tree:
        """Who sends each entry to member ``member`` (see :class:`_Tree`): one of ``rotations``
        trees, chosen per member by :func:`_assign_trees` so that forwarding work spreads."""
        return self.tree_at(self.offsets[member] if self.offsets else 0)

    def tree_at(self, t: int) -> _Tree:
        hit = self._trees.get(t)
        if hit is None:
            hit = self._trees[t] = self._build_tree(t)
        return hit

    def _build_tree(self, offset: int) -> _Tree:
        # which piece receives each region from the source: every piece without fan-out; with it,
        # the requesters of a region form a binary tree — a requester already holding the region
        # (colocated) at the root, the rest in an order rotated by region and member, so that the
        # root and the inner (forwarding) nodes change from region to region and tensor to tensor —
        # and node i receives from node (i − 1) // 2 in phase ⌊log2(i + 1)⌋: every rank forwards
        # at most twice what it receives, and each region leaves the source once
        g = self.geo
        E = g.piece.size
        parent, phase = g.piece.copy(), np.zeros(E, np.int64)
        if self.fan_out and E:
            rot = (self._j + g.key + offset) % self._c
            if not self.is_local.any():  # the tree order is the rotation itself: node i = rot, no sort
                i = rot
                inner = i > 0
                # the entry of the same region at node (i − 1) // 2: j = (node − key − offset) mod c
                pj = ((i[inner] - 1) // 2 - g.key[inner] - offset) % self._c[inner]
                parent[inner] = g.piece[self._first[self._start[inner] + pj]]
            else:
                order = np.lexsort((rot, ~self.is_local, g.key))
                starts, counts = self._starts, self._counts
                i = np.empty(E, np.int64)
                i[order] = np.arange(E) - np.repeat(starts, counts)  # node index within its region's tree
                start_of = np.empty(E, np.int64)
                start_of[order] = np.repeat(starts, counts)
                inner = i > 0
                parent[inner] = g.piece[order[start_of[inner] + (i[inner] - 1) // 2]]
            phase[inner] = np.frexp(i[inner] + 1)[1] - 1  # ⌊log2(i + 1)⌋, exact
            is_leader = i == 0
            phase[self.is_local] = 0
        else:
            is_leader = np.ones(E, bool)
        sender = np.where(is_leader, self._src_sender, self._dst_r[self._dst_pos[parent]])
        return _Tree(is_leader, parent, phase, sender)

    @property
    def members(self) -> list[tuple[str, Demand]]:
        """``[(tensor name, Demand)]``, in planning order."""
        return [(t, Demand(p, self.pattern, s)) for t, p, s in zip(self.tensors, self.params, self.shifts)]

    def member_counts(self) -> list[tuple[_Tree, int]]:
        """Each tree in use with the number of members using it."""
        return [(self.tree_at(t), k) for t, k in self.offset_counts()]

    def offset_counts(self) -> list[tuple[int, int]]:
        """``(tree, members using it)`` for each tree in use."""
        if not self.offsets:
            return [(0, len(self.tensors))]
        counts = np.bincount(np.asarray(self.offsets, np.int64), minlength=self.rotations)
        return [(t, int(k)) for t, k in enumerate(counts.tolist()) if k]

    def sent(self, t: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(ranks, bytes, egress)`` for one member under tree ``t``: the bytes each physical rank sends (local
        copies excluded) and those that leave the source. Without local copies in a fan-out group this is counted
        from the tree's shape, not built: the entry at node ``i`` of its region's tree (``i`` = its rotation)
        forwards the region to its ``clip(c − 2i − 1, 0, 2)`` children and the root (``i = 0``) receives it from the
        source — the senders :meth:`tree_at` would find, summed, with no parent looked up."""
        nb = self.geo.numel * self.itemsize
        if self.fan_out and nb.size and not self.is_local.any():
            cls = self._classes()
            rot = (cls.v + t) % cls.c
            sent = np.where(cls.source, np.where(rot == 0, cls.w, 0), cls.w * np.clip(cls.c - 2 * rot - 1, 0, 2))
            some = sent > 0  # the ranks that send (a leaf forwards nothing: not a sender of this tree)
            r, b = _sum_by(cls.rank[some], sent[some])
            return np.asarray(r, np.int64), np.asarray(b, np.int64), int(sent[cls.source].sum())
        remote = ~self.is_local
        tree = self.tree_at(t)
        r, b = _sum_by(tree.sender[remote], nb[remote])
        return np.asarray(r, np.int64), np.asarray(b, np.int64), int(nb[remote & tree.is_leader].sum())

    def _classes(self) -> _Classes:
        """The group's entries summed into classes that every tree treats alike (once per group): on the
        destination side ``(receiving rank, c, v)`` and on the source side ``(sending rank, c, v)``, where ``c`` is
        the region's requester count and ``v = (j + key) mod c`` its rotation base — tree ``t`` puts the entry at
        node ``(v + t) mod c``. Each tree then costs O(classes), not O(entries) (262,144 entries, ≤ 8,192 classes
        for a DeepSeek-V3 norm)."""
        if self._cls is not None:
            return self._cls
        nb = (self.geo.numel * self.itemsize).astype(np.float64)
        v = (self._j + self.geo.key) % self._c
        cs, ci = np.unique(self._c, return_inverse=True)
        C1 = int(cs.max()) + 1
        parts = []
        for source, rank in ((False, self.dst_rank), (True, self._src_sender)):
            key = (rank * len(cs) + ci.reshape(-1)) * C1 + v
            w = np.bincount(key, weights=nb)
            k = np.flatnonzero(w)
            parts.append((np.full(k.size, source), k // (len(cs) * C1), cs[(k // C1) % len(cs)], k % C1,
                          np.rint(w[k]).astype(np.int64)))
        self._cls = _Classes(*(np.concatenate(x) for x in zip(*parts)))
        return self._cls

    def out_bytes(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ranks, bytes)`` sent per physical rank by one member under tree ``t``."""
        return self.sent(t)[:2]

    def __len__(self) -> int:
        return int(self.geo.piece.size)


class Plan:
    """A reshard plan: groups of tensors sharing one geometry; iterate for the transfers."""

    def __init__(self, src: Layout, dst: DstLayout, groups: list[_Group], fan_out: bool):
        self.src, self.dst, self.groups, self.fan_out = src, dst, groups, fan_out

    def __iter__(self):
        for g in self.groups:
            for k, (tensor, param, shift) in enumerate(zip(g.tensors, g.params, g.shifts)):
                yield from _materialise(g, g.tree(k), tensor, param, shift)

    def transfers(self) -> list[Transfer]:
        return list(self)

    def __len__(self) -> int:
        return sum(len(g) * len(g.tensors) for g in self.groups)

    def stats(self) -> PlanStats:
        """Byte accounting per group (vectorised), multiplied by the group's member count (:mod:`.report`)."""
        return plan_stats(self)

    def traffic(self) -> tuple[list[int], list[int], np.ndarray]:
        """Bytes on the wire per (sender, receiver): ``(senders, receivers, matrix [S, R])`` (:mod:`.report`)."""
        return plan_traffic(self)

    def __str__(self) -> str:
        return plan_str(self)

    def buckets(self, max_bytes: int) -> list[list[Transfer]]:
        """Transfers packed under a per-rank staging cap (computed once per cap: a publisher
        executes the same plan every version)."""
        cache = self.__dict__.setdefault("_buckets", {})
        if max_bytes not in cache:
            cache[max_bytes] = bucketize(self.transfers(), max_bytes)
        return cache[max_bytes]


def _materialise(g: _Group, tree: _Tree, tensor: str, param: str, shift: tuple[int, ...]):
    pattern = g.pattern
    geo = g.geo
    extra = len(shift) - geo.inter_lo.shape[1]
    rows = zip(geo.piece.tolist(), geo.src_lo.tolist(), geo.inter_lo.tolist(), geo.size.tolist(),
               g.is_local.tolist(), tree.is_leader.tolist(), tree.parent.tolist(), tree.phase.tolist(),
               tree.sender.tolist(), g.dst_rank.tolist(), geo.numel.tolist())
    for piece_i, src_lo, lo, size, local, leader, parent, phase, sender, dst, numel in rows:
        piece = pattern[piece_i]
        sizes = (1,) * extra + tuple(size)
        dst_off = _dst_offset(piece, shift, lo, extra)
        dst_slice = Box(dst_off, sizes)
        nb = numel * g.itemsize
        src_slice = Box(tuple(a - b for a, b in zip(lo, src_lo)), tuple(size))
        if local:
            yield Transfer(dst, dst, tensor, src_slice, param, dst_slice, nb, 0, True)
        elif leader:
            yield Transfer(sender, dst, tensor, src_slice, param, dst_slice, nb, 0, False)
        else:  # forwarded from the parent's copy (its local param) in a later phase
            parent_off = _dst_offset(pattern[parent], shift, lo, extra)
            yield Transfer(sender, dst, tensor, Box(parent_off, sizes), param, dst_slice, nb, phase, False)


def _dst_offset(piece, shift, lo, extra) -> tuple[int, ...]:
    """Where source element ``lo`` lands in the destination local param (stacked params have
    ``extra`` leading dims that the source does not)."""
    rel = (0,) * extra + tuple(a - b for a, b in zip(lo, piece.src_box.offsets))
    return tuple(o + s + r for o, s, r in zip(piece.dst_offset, shift, rel))


def reshard_plan(src: Layout, dst: DstLayout, *, fan_out: bool | str = False, links=None) -> Plan:
    """Plan moving every tensor of ``src`` into the destination parameters of ``dst``.

    Each destination element is received exactly once; elements the receiving physical rank
    already holds are local copies. Among source replicas the sender rotates with the piece, which
    spreads bytes evenly over replicas. ``fan_out``: a region needed by several destination
    replicas leaves the source once (to the first requester, or to one that holds it locally)
    and is forwarded among them, so source egress falls to the unique bytes ``B_src_min``.
    ``links`` (:class:`~.timing.Links`): among source replicas prefer one on the receiver's node;
    with ``fan_out="auto"`` plan both ways and keep the one :func:`~.timing.predict` finds faster.
    Raises :class:`LayoutError` listing mismatched names, shapes and dtypes.
    """
    if fan_out == "auto":
        if links is None:
            raise ValueError("fan_out='auto' needs links= (a timing.Links) to compare the two plans by")
        from hyperrl.sharding.timing import predict

        plans = [reshard_plan(src, dst, fan_out=f, links=links) for f in (False, True)]
        return min(plans, key=lambda p: predict(p, links).seconds)
    if fan_out not in (False, True):
        raise ValueError(f"fan_out={fan_out!r}: True, False or 'auto'")
    with _no_gc():
        return _plan(src, dst, fan_out, links)


@contextlib.contextmanager
def _no_gc():
    """The cyclic collector paused while planning: the plan allocates ~10⁵ small objects and
    creates no cycles, and each collection re-walks every object the two layouts hold (~0.5 s of
    a DeepSeek-V3 plan). Reference counting still frees everything; the previous state is restored."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(src: Layout, dst: DstLayout, fan_out: bool, links) -> Plan:
    grids: dict = {}  # (mesh axes, shape, spec dims) → (source grid, its geometries)
    placed: dict = {}  # (shape, spec dims, mesh, itemsize) → the first placement so
    groups: list[_Group] = []
    seqs: list[list[int]] = []  # per group, each member's place in the walk
    shared: dict = {}
    placements = src._p
    rpn = links.ranks_per_node if links is not None else 0
    by_key: dict = {}  # (placement key, pattern id, destination mesh id) → the group's appends: one lookup a demand
    n = 0
    # one walk over the destination's demands as they are made (no Demand objects, no per-tensor lists), checking
    # each against its source as check_compatible does (which names every mismatch when one is found) …
    for param, p, blocks, results in dst.demanded_parts():
        mesh, dtype = p.mesh, p.dtype
        mesh_id = id(mesh)
        for block, (pattern, shift) in zip(blocks, results):
            tensor = block.src
            pl = placements.get(tensor)
            if pl is None or pl.shape != block.shape or pl.dtype != dtype:
                _incompatible(src, dst)
            # ints and flat tuples only (meshes by identity — both layouts hold them alive): hashing the spec object,
            # nested tuples or 1,024-rank meshes per tensor cost most of a DeepSeek-V3 plan
            key = (pl.shape, pl.spec.dims, id(pl.mesh), pl.dtype.itemsize, id(pattern), mesh_id)
            hit = by_key.get(key)
            if hit is None:
                grp = _new_group(grids, placed, pl, pattern, mesh, fan_out, rpn, shared)
                groups.append(grp)
                seqs.append([])
                hit = by_key[key] = (grp.tensors.append, grp.params.append, grp.shifts.append, seqs[-1].append)
            add_tensor, add_param, add_shift, add_seq = hit
            add_tensor(tensor)
            add_param(param)
            add_shift(shift)
            add_seq(n)
            n += 1
    # (a source tensor nothing reads is found only now, after the walk built its groups' geometries: a failing layout
    # costs a walk before its error — the same error)
    read: set = set()
    for grp in groups:
        read.update(grp.tensors)
    if len(read) != len(placements):  # a source tensor no destination parameter reads
        _incompatible(src, dst)
    groups = _in_tensor_order(groups, seqs)
    if fan_out:
        _assign_trees(groups)
    return Plan(src, dst, groups, fan_out)


def _incompatible(src: Layout, dst: DstLayout) -> None:
    check_compatible(src, dst)  # raises LayoutError listing every mismatch
    raise AssertionError("the planner found a mismatch that check_compatible did not")


def _in_tensor_order(groups: list[_Group], seqs: list[list[int]]) -> list[_Group]:
    """The plan's order: that of a walk over the source tensors by name, each tensor's demands in the destination's
    order — each group's members sorted by tensor name (stably: ``seqs`` is the walk), the groups by their first."""
    firsts = []
    for grp, seq in zip(groups, seqs):
        t = grp.tensors
        idx = sorted(range(len(t)), key=t.__getitem__)
        if any(i != j for i, j in enumerate(idx)):
            grp.tensors, grp.params, grp.shifts = [t[i] for i in idx], [grp.params[i] for i in idx], \
                [grp.shifts[i] for i in idx]
        firsts.append((grp.tensors[0], seq[idx[0]]))
    return [groups[k] for k in sorted(range(len(groups)), key=firsts.__getitem__)]


def _new_group(grids: dict, placed: dict, pl: Placement, pattern, mesh, fan_out: bool, rpn: int, shared: dict):
    """The group of tensors placed like ``pl`` that ``pattern`` requests on ``mesh``: its source grid (one per
    mesh axes, shape and spec) and the pattern's geometry on it computed once, reused by every group sharing them."""
    pkey = (pl.shape, pl.spec.dims, id(pl.mesh), pl.dtype.itemsize)
    first = placed.setdefault(pkey, pl)  # the first tensor placed so: its sizes and ranks stand for all
    gkey = (pl.mesh.axes, pl.shape, pl.spec.dims)
    grid = grids.get(gkey)
    if grid is None:
        grid = grids[gkey] = (src_grid(pl), {})
    geo = grid[1].get(id(pattern))
    if geo is None:
        geo = grid[1][id(pattern)] = geometry(grid[0], pattern)
    return _Group(geo, pattern, first.nbytes, first.itemsize, first.mesh.ranks, mesh.ranks, fan_out,
                  ranks_per_node=rpn, shared=shared)


TREES = 8  # fan-out trees per group to choose from (each costs one pass over the group's classes: _Group.sent)


def _assign_trees(groups: list[_Group]) -> None:
    """Choose each member's fan-out tree so that the busiest sender stays close to its bound.
    Largest groups first; a group's members take ``R = min(rotations, TREES)`` trees (rotations
    spaced evenly) in turn, ``m // R`` each, and the remaining ``m % R`` members go greedily to
    the tree whose busiest touched rank ends up least loaded (ties: the lower index). Deterministic."""
    top = max((max(g.src_ranks + g.dst_ranks) for g in groups), default=0)
    load = np.zeros(top + 1, np.int64)
    for g in sorted(groups, key=lambda g: (-g.tensor_nbytes * len(g.tensors), g.src_ranks, g.dst_ranks)):
        m = len(g.tensors)
        R = min(g.rotations, TREES)  # candidate trees, their rotations spaced evenly over the requesters
        cand = [t * g.rotations // R for t in range(R)]
        full, rem = divmod(m, R)
        g.offsets = [cand[k % R] for k in range(full * R)]
        vecs = [g.out_bytes(t) for t in cand]
        if full:
            for ranks, b in vecs:
                np.add.at(load, ranks, b * full)
        for _ in range(rem):
            peaks = [int((load[ranks] + b).max()) if ranks.size else 0 for ranks, b in vecs]
            best = int(np.argmin(peaks))
            g.offsets.append(cand[best])
            np.add.at(load, vecs[best][0], vecs[best][1])
