"""Reports of a plan: byte statistics (:class:`PlanStats`), the traffic matrix and a printable
listing — read from the planner's groups, vectorised; nothing here plans."""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np

__all__ = ["PlanStats", "plan_stats", "plan_traffic", "plan_str"]


class PlanStats(NamedTuple):
    """Byte statistics of a plan (:func:`plan_stats`). ``max_in`` / ``mean_in``: non-local bytes received per
    destination rank (max, mean); ``max_out`` / ``mean_out``: bytes sent per sending rank (sources, plus
    destination replicas under fan-out)."""

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
    busiest_out_rank: int  # the rank sending the most bytes (-1: nothing crosses ranks)
    max_out_bound: float  # what the busiest rank is compared with: the larger of the sources' mean egress and
    #                       the forwarding replicas' mean forwards (no split of that traffic has a smaller max)

    def table(self) -> str:
        rows = [
            ("wire bytes", self.wire_bytes), ("B_recv_min", self.recv_min_bytes),
            ("source egress", self.egress_bytes), ("B_src_min", self.src_min_bytes),
            ("local copies", self.local_bytes), ("fan-out forwards", self.forward_bytes),
            ("max in / rank", self.max_in), ("mean in / rank", self.mean_in),
            ("max out / rank", self.max_out), ("mean out / rank", self.mean_out),
            ("busiest rank's bound", self.max_out_bound),
            ("full-gather + broadcast", self.full_gather_bytes),
        ]
        lines = [f"{k:<24} {_human(v):>14}" for k, v in rows]
        lines += [f"{'messages':<24} {self.messages:>12,}", f"{'transfers (incl. local)':<24} {self.transfers:>12,}",
                  f"{'wire / B_recv_min':<24} {self.wire_bytes / max(self.recv_min_bytes, 1):>12.3f}",
                  f"{'egress / B_src_min':<24} {self.egress_bytes / max(self.src_min_bytes, 1):>12.3f}",
                  f"{'full-gather / wire':<24} {self.full_gather_bytes / max(self.wire_bytes, 1):>12.2f}",
                  f"{'busiest rank':<24} {self.busiest_out_rank:>12}",
                  f"{'max out / bound':<24} {self.max_out / max(self.max_out_bound, 1):>12.3f}"]
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def plan_stats(plan) -> PlanStats:
    """Byte accounting per group (vectorised), multiplied by the group's member count."""
    inb: dict[int, int] = defaultdict(int)
    outb: dict[int, int] = defaultdict(int)
    wire = local = fwd = egress = src_min = msgs = transfers = full = needed = 0
    for g in plan.groups:
        m, geo = len(g.tensors), g.geo
        nb = geo.numel * g.itemsize
        needed += sum(p.src_box.numel for p in g.pattern) * g.itemsize * m
        transfers += len(g) * m
        local += int(nb[g.is_local].sum()) * m
        remote = ~g.is_local
        msgs += int(remote.sum()) * m
        wire += int(nb[remote].sum()) * m
        wire_one = int(nb[remote].sum())
        for t, k in g.offset_counts():
            ranks, sent, eg = g.sent(t)
            egress += eg * k
            fwd += (wire_one - eg) * k
            for r, b in zip(ranks.tolist(), sent.tolist()):
                outb[r] += b * k
        for r, b in zip(*_sum_by(g.dst_rank[remote], nb[remote])):
            inb[r] += b * m
        # unique regions that some requester lacks and no requester holds locally
        held = np.zeros(int(geo.key.max()) + 1 if geo.key.size else 0, bool)
        held[geo.key[g.is_local]] = True
        need = np.zeros_like(held)
        need[geo.key[remote]] = True
        region_bytes = np.zeros(held.size, np.int64)
        region_bytes[geo.key] = nb
        src_min += int(region_bytes[need & ~held].sum()) * m
        full += len({p.dst_pos for p in g.pattern}) * g.tensor_nbytes * m
    ranks_in, ranks_src = plan.dst.ranks(), plan.src.ranks()
    ranks_out = ranks_src | (ranks_in if plan.fan_out else set())
    busiest = max(outb, key=lambda r: (outb[r], -r)) if outb else -1
    bound = max(egress / max(len(ranks_src), 1), fwd / max(len(ranks_in), 1))
    return PlanStats(
        wire, needed - local, egress, src_min, local, fwd, msgs, transfers,
        max(inb.values(), default=0), sum(inb.values()) / max(len(ranks_in), 1),
        max(outb.values(), default=0), sum(outb.values()) / max(len(ranks_out), 1), full, busiest, bound,
    )


def plan_traffic(plan) -> tuple[list[int], list[int], np.ndarray]:
    """Bytes on the wire per (sender, receiver): ``(senders, receivers, matrix [S, R])``,
    local copies excluded; senders include destination replicas that forward."""
    pairs: dict[tuple[int, int], int] = defaultdict(int)
    for g in plan.groups:
        remote = ~g.is_local
        for tree, k in g.member_counts():
            nb = g.geo.numel[remote] * g.itemsize * k
            for (a, b), v in zip(zip(tree.sender[remote].tolist(), g.dst_rank[remote].tolist()), nb.tolist()):
                pairs[(a, b)] += v
    senders = sorted({a for a, _ in pairs})
    receivers = sorted({b for _, b in pairs})
    si, ri = {r: i for i, r in enumerate(senders)}, {r: i for i, r in enumerate(receivers)}
    m = np.zeros((len(senders), len(receivers)), np.int64)
    for (a, b), v in pairs.items():
        m[si[a], ri[b]] = v
    return senders, receivers, m


def plan_str(plan) -> str:
    """A readable summary of a plan: its counts, then its first 20 transfers one per line."""
    head = (f"Plan: {len(plan.src)} source tensors -> {len(plan.dst)} destination params, "
            f"{len(plan.groups)} geometry groups, {len(plan):,} transfers, fan_out={plan.fan_out}")
    lines = [head]
    for i, t in enumerate(plan):
        if i == 20:
            lines.append("  …")
            break
        lines.append("  " + str(t))
    return "\n".join(lines)


def _sum_by(keys: np.ndarray, values: np.ndarray):
    """``values`` summed by ``keys``: (the distinct keys ascending, their sums). Keys that are small
    non-negative integers (rank numbers) are counted straight into their range — O(n), where
    ``np.unique`` sorts (the fan-out planner calls this once per tree: most of its time was the sort)."""
    if keys.size == 0:
        return [], []
    k, v = keys.reshape(-1), values.reshape(-1)
    if np.issubdtype(k.dtype, np.integer) and int(k.min()) >= 0 and int(k.max()) < max(4 * k.size, 1 << 16):
        present = np.flatnonzero(np.bincount(k))
        return present.tolist(), np.bincount(k, weights=v)[present].astype(np.int64).tolist()
    u, inv = np.unique(k, return_inverse=True)
    return u.tolist(), np.bincount(inv.reshape(-1), weights=v).astype(np.int64).tolist()
