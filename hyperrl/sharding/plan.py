"""The direct-reshard planner: exactly the intersections of source and destination shards.

``reshard_plan(src, dst)`` returns a :class:`Plan` — plain data in a deterministic order. For
every source tensor and every destination piece that reads it, the planner intersects the piece
with the source shards by a per-dimension interval sweep (bisect over each dim's sorted chunk
intervals, never all-pairs box tests) and memoises the result by the signature (shape, dtype,
spec, mesh shape, demand pattern), so identically placed tensors — the 44,544 routed experts of
DeepSeek-V3 — are planned once and shared. A plan is a list of *groups*: one geometry, one
source rank map, one destination rank map and the tensors that share them; transfers are
materialised lazily (``iter(plan)``), statistics are computed per group.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import product
from typing import NamedTuple

from .layout import Demand, DstLayout, Layout, Placement, check_compatible
from .spec import Box, dim_intervals

__all__ = ["Transfer", "Plan", "PlanStats", "reshard_plan"]


class Transfer(NamedTuple):
    src_rank: int
    dst_rank: int
    tensor: str  # source tensor name
    src_slice: Box  # phase 0: in the sender's local shard of `tensor`; phase 1: in its local `param`
    param: str  # destination parameter
    dst_slice: Box  # in the receiver's local `param`
    nbytes: int
    phase: int  # 0: from the source; 1: forwarded by a destination replica (fan-out)
    local: bool  # sender and receiver are the same physical rank: a local copy

    def __str__(self) -> str:
        kind = "local" if self.local else ("fwd" if self.phase else "send")
        return (f"{kind:5} {self.src_rank:>5} -> {self.dst_rank:<5} {self.tensor}{self.src_slice} -> "
                f"{self.param}{self.dst_slice} ({self.nbytes} B)")


class _Entry(NamedTuple):
    piece: int  # index into the demand pattern
    src_box: Box  # the holders' shard box (global coords)
    inter: Box  # intersection (global coords of the source tensor)
    holders: tuple[int, ...]  # source mesh positions holding it (replicas)
    sender: int  # balanced choice among holders
    key: int  # identifies the (source shard, intersection) region: replicas of a region share it


@dataclass(frozen=True)
class _SrcGrid:
    """Per-dim sorted chunk intervals of one source placement, and the replica sets."""

    intervals: tuple[tuple[tuple[int, int], ...], ...]
    starts: tuple[tuple[int, ...], ...]
    holders: dict


def _src_grid(pl: Placement) -> _SrcGrid:
    mesh, spec = pl.mesh, pl.spec
    ivs = tuple(tuple(dim_intervals(L, tuple(mesh.axis_size(a) for a in axes))) for L, axes in zip(pl.shape, spec.dims))
    holders = defaultdict(list)
    for pos, c in mesh.coords():
        key = []
        for axes in spec.dims:
            k = 0
            for a in axes:
                k = k * mesh.axis_size(a) + c[a]
            key.append(k)
        holders[tuple(key)].append(pos)
    return _SrcGrid(ivs, tuple(tuple(lo for lo, _ in iv) for iv in ivs), {k: tuple(v) for k, v in holders.items()})


def _overlapping(iv, starts, lo: int, hi: int) -> list[int]:
    """Indices of non-empty intervals overlapping ``[lo, hi)`` (sorted, contiguous chunks)."""
    k0 = max(bisect_right(starts, lo) - 1, 0)
    k1 = bisect_left(starts, hi)
    return [k for k in range(k0, k1) if iv[k][1] > iv[k][0] and iv[k][1] > lo]


def _geometry(grid: _SrcGrid, pattern, itemsize: int, fan_out: bool) -> tuple[_Entry, ...]:
    load: dict[int, int] = defaultdict(int)
    keys: dict[tuple, int] = {}
    out = []
    for i, piece in enumerate(pattern):
        box = piece.src_box
        if box.numel == 0:
            continue
        per_dim = [_overlapping(grid.intervals[d], grid.starts[d], o, o + s)
                   for d, (o, s) in enumerate(zip(box.offsets, box.sizes))]
        for ks in product(*per_dim):
            iv = [grid.intervals[d][k] for d, k in enumerate(ks)]
            src_box = Box(tuple(lo for lo, _ in iv), tuple(hi - lo for lo, hi in iv))
            inter = src_box.intersect(box)
            holders = grid.holders[ks]
            nb = inter.numel * itemsize
            n_keys = len(keys)
            key = keys.setdefault((ks, inter), n_keys)
            sender = min(holders, key=lambda h: (load[h], h))
            if key == n_keys or not fan_out:
                load[sender] += nb
            out.append(_Entry(i, src_box, inter, holders, sender, key))
    return tuple(out)


@dataclass
class _Group:
    entries: tuple[_Entry, ...]
    pattern: tuple
    tensor_nbytes: int
    itemsize: int
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    fan_out: bool
    members: list = field(default_factory=list)  # [(tensor name, Demand)]

    def __post_init__(self):
        # per entry: the piece that receives its region from the source. Without fan-out every
        # piece does; with it, the first requester that already holds the region locally (a
        # colocated replica), else the first requester, and the others get it forwarded.
        self.is_local = tuple(self.dst_ranks[self.pattern[e.piece].dst_pos] in {self.src_ranks[h] for h in e.holders}
                              for e in self.entries)
        first: dict[int, int] = {}
        local_first: dict[int, int] = {}
        if self.fan_out:
            for e, loc in zip(self.entries, self.is_local):
                first.setdefault(e.key, e.piece)
                if loc:
                    local_first.setdefault(e.key, e.piece)
        self.leader = tuple(local_first.get(e.key, first.get(e.key, e.piece)) for e in self.entries)


class PlanStats(NamedTuple):
    wire_bytes: int  # bytes crossing between physical ranks (phase 0 + forwards)
    recv_min_bytes: int  # B_recv_min: every destination element not already local, once
    egress_bytes: int  # bytes leaving source ranks
    src_min_bytes: int  # B_src_min: unique bytes that must leave the source at all
    local_bytes: int  # satisfied by local copies
    forward_bytes: int  # fan-out traffic among destination replicas
    messages: int  # non-local transfers
    transfers: int  # all transfers, local copies included
    max_in: int
    mean_in: float
    max_out: int
    mean_out: float
    full_gather_bytes: int  # what gather-full-tensor + broadcast delivers to destination ranks

    def table(self) -> str:
        rows = [
            ("wire bytes", self.wire_bytes), ("B_recv_min", self.recv_min_bytes),
            ("source egress", self.egress_bytes), ("B_src_min", self.src_min_bytes),
            ("local copies", self.local_bytes), ("fan-out forwards", self.forward_bytes),
            ("max in / rank", self.max_in), ("mean in / rank", self.mean_in),
            ("max out / rank", self.max_out), ("mean out / rank", self.mean_out),
            ("full-gather + broadcast", self.full_gather_bytes),
        ]
        lines = [f"{k:<24} {_human(v):>14}" for k, v in rows]
        lines += [f"{'messages':<24} {self.messages:>12,}", f"{'transfers (incl. local)':<24} {self.transfers:>12,}",
                  f"{'wire / B_recv_min':<24} {self.wire_bytes / max(self.recv_min_bytes, 1):>12.3f}",
                  f"{'egress / B_src_min':<24} {self.egress_bytes / max(self.src_min_bytes, 1):>12.3f}",
                  f"{'full-gather / wire':<24} {self.full_gather_bytes / max(self.wire_bytes, 1):>12.2f}"]
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


class Plan:
    """A reshard plan: groups of tensors sharing one geometry; iterate for the transfers."""

    def __init__(self, src: Layout, dst: DstLayout, groups: list[_Group], fan_out: bool):
        self.src, self.dst, self.groups, self.fan_out = src, dst, groups, fan_out

    def __iter__(self):
        for g in self.groups:
            for tensor, demand in g.members:
                yield from _materialise(g, tensor, demand, self.src[tensor])

    def transfers(self) -> list[Transfer]:
        return list(self)

    def __len__(self) -> int:
        return sum(len(g.entries) * len(g.members) for g in self.groups)

    def stats(self) -> PlanStats:
        inb: dict[int, int] = defaultdict(int)
        outb: dict[int, int] = defaultdict(int)
        wire = local = fwd = egress = src_min = msgs = transfers = full = needed = 0
        for g in self.groups:
            m = len(g.members)
            needed += sum(p.src_box.numel for p in g.pattern) * g.itemsize * m
            remote: dict[int, int] = {}
            held_locally = set()
            for e, is_local, leader in zip(g.entries, g.is_local, g.leader):
                piece = g.pattern[e.piece]
                dst = g.dst_ranks[piece.dst_pos]
                nb = e.inter.numel * g.itemsize * m
                transfers += m
                if is_local:
                    local += nb
                    held_locally.add(e.key)
                    continue
                remote[e.key] = e.inter.numel
                sender = g.src_ranks[e.sender] if leader == e.piece else g.dst_ranks[g.pattern[leader].dst_pos]
                msgs += m
                wire += nb
                inb[dst] += nb
                outb[sender] += nb
                if leader == e.piece:
                    egress += nb
                else:
                    fwd += nb
            src_min += sum(n for k, n in remote.items() if k not in held_locally) * g.itemsize * m
            full += len({p.dst_pos for p in g.pattern}) * g.tensor_nbytes * m
        ranks_in = self.dst.ranks()
        ranks_out = self.src.ranks() | (ranks_in if self.fan_out else set())
        return PlanStats(
            wire, needed - local, egress, src_min, local, fwd, msgs, transfers,
            max(inb.values(), default=0), sum(inb.values()) / max(len(ranks_in), 1),
            max(outb.values(), default=0), sum(outb.values()) / max(len(ranks_out), 1), full,
        )

    def __str__(self) -> str:
        head = (f"Plan: {len(self.src)} source tensors -> {len(self.dst)} destination params, "
                f"{len(self.groups)} geometry groups, {len(self):,} transfers, fan_out={self.fan_out}")
        lines = [head]
        for i, t in enumerate(self):
            if i == 20:
                lines.append("  …")
                break
            lines.append("  " + str(t))
        return "\n".join(lines)

    def buckets(self, max_bytes: int) -> list[list[Transfer]]:
        from .buckets import bucketize

        return bucketize(self.transfers(), max_bytes)


def _materialise(g: _Group, tensor: str, demand: Demand, pl: Placement):
    pattern, shift = g.pattern, demand.shift
    for e, is_local, leader in zip(g.entries, g.is_local, g.leader):
        piece = pattern[e.piece]
        dst = g.dst_ranks[piece.dst_pos]
        off = tuple(o + s + (i - b) for o, s, i, b in zip(piece.dst_offset, shift, _pad(e.inter, shift),
                                                              _pad(piece.src_box, shift)))
        dst_slice = Box(off, _pad_sizes(e.inter, shift))
        nb = e.inter.numel * g.itemsize
        if is_local:
            yield Transfer(dst, dst, tensor, e.inter.relative_to(e.src_box), demand.param, dst_slice, nb, 0, True)
        elif leader == e.piece:
            yield Transfer(g.src_ranks[e.sender], dst, tensor, e.inter.relative_to(e.src_box), demand.param,
                           dst_slice, nb, 0, False)
        else:
            lead = pattern[leader]
            lead_off = tuple(o + s + (i - b) for o, s, i, b in zip(lead.dst_offset, shift, _pad(e.inter, shift),
                                                                    _pad(lead.src_box, shift)))
            src_rank = g.dst_ranks[lead.dst_pos]
            yield Transfer(src_rank, dst, tensor, Box(lead_off, dst_slice.sizes), demand.param, dst_slice, nb, 1, False)


def _pad(box: Box, shift) -> tuple[int, ...]:
    """Source-box offsets aligned with the destination dims (stacked params have one more)."""
    extra = len(shift) - len(box.offsets)
    return (0,) * extra + box.offsets


def _pad_sizes(box: Box, shift) -> tuple[int, ...]:
    extra = len(shift) - len(box.sizes)
    return (1,) * extra + box.sizes


def reshard_plan(src: Layout, dst: DstLayout, *, fan_out: bool = False) -> Plan:
    """Plan moving every tensor of ``src`` into the destination parameters of ``dst``.

    Each destination element is received exactly once; elements the receiving physical rank
    already holds are local copies. Senders are chosen among source replicas to balance bytes.
    ``fan_out``: a piece needed by several destination replicas leaves the source once (to the
    lowest-position replica) and is forwarded among them, so source egress falls to the unique
    bytes ``B_src_min``. Raises :class:`LayoutError` listing mismatched names, shapes, dtypes.
    """
    check_compatible(src, dst)
    demands = dst.demands()
    grids: dict = {}
    geoms: dict = {}
    groups: dict = {}
    for tensor in sorted(demands):
        pl = src[tensor]
        gkey = (pl.shape, pl.spec, pl.mesh.axes)
        grid = grids.get(gkey)
        if grid is None:
            grid = grids[gkey] = _src_grid(pl)
        for demand in demands[tensor]:
            param = dst.params[demand.param]
            key = (gkey, pl.itemsize, id(demand.pattern))
            entries = geoms.get(key)
            if entries is None:
                entries = geoms[key] = _geometry(grid, demand.pattern, pl.itemsize, fan_out)
            k = (key, pl.mesh.ranks, param.mesh.ranks)
            grp = groups.get(k)
            if grp is None:
                grp = groups[k] = _Group(entries, demand.pattern, pl.nbytes, pl.itemsize, pl.mesh.ranks,
                                         param.mesh.ranks, fan_out)
            grp.members.append((tensor, demand))
    return Plan(src, dst, list(groups.values()), fan_out)

