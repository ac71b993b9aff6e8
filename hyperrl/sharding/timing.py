"""A time model for a publication: the slowest rank's bytes over its links, plus per-message latency.

``Links(intra, inter, latency, ranks_per_node)``: per-rank bandwidth (bytes/s) to a rank on the
same node and to one on another node (``rank // ranks_per_node`` is the node), and the fixed cost
of one message. ``predict(plan, links)`` charges every rank, in every phase of the plan (fan-out
phases run one after another, as the executors do), the time to send and the time to receive its
bytes::

    t_send(r, p) = Σ_link bytes_out(r, p, link) / bw(link) + messages_out(r, p) · latency
    t(p)         = max_r [max(t_send(r, p), t_recv(r, p)) + t_local(r, p)]
    t_local(r, p) = bytes_local(r, p) / bw_local + copies(r, p) · copy_latency
    T            = Σ_p t(p)

Local copies (a colocated rank already holding what it needs) cost memory bandwidth (``local``,
``inf`` — free — by default) and a fixed cost each; the executors run them before the bucket's
messages. ``duplex=False`` (a rank whose sends and receives share one resource — gloo on an
oversubscribed CPU) charges ``t_send + t_recv`` instead of their maximum. This is the standard
α–β (latency–bandwidth) model with no contention beyond each rank's own: the busiest rank sets
the time.
``reshard_plan(..., fan_out="auto", links=links)`` plans with and without fan-out and keeps the
prediction's minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["Links", "TimePrediction", "predict", "parse_links"]


@dataclass(frozen=True)
class Links:
    """The time model's links (see the module doc): per-rank bandwidths within and across nodes (node =
    ``rank // ranks_per_node``), per-message ``latency``, local-copy costs and whether sends and receives overlap."""

    intra: float  # bytes/s per rank, same node
    inter: float  # bytes/s per rank, across nodes
    latency: float = 0.0  # seconds per message
    ranks_per_node: int = 8
    local: float = float("inf")  # bytes/s of a local copy
    copy_latency: float = 0.0  # seconds per local copy
    duplex: bool = True  # sends and receives of a rank overlap

    def __post_init__(self):
        if self.intra <= 0 or self.inter <= 0:
            raise ValueError(f"bandwidths must be > 0 (intra={self.intra}, inter={self.inter})")
        if self.latency < 0 or self.ranks_per_node < 1:
            raise ValueError(f"latency={self.latency} must be ≥ 0 and ranks_per_node={self.ranks_per_node} ≥ 1")


class TimePrediction(NamedTuple):
    """:func:`predict`'s result: the predicted time ``T`` in seconds, each phase's ``t(p)``, and the rank and
    direction that set the longest phase."""

    seconds: float
    phase_seconds: tuple[float, ...]
    slowest_rank: int  # the rank setting the time of the longest phase
    slowest_direction: str  # "send" or "recv"

    def __str__(self) -> str:
        phases = ", ".join(f"{s * 1e3:.3g}" for s in self.phase_seconds)
        return (f"predicted {self.seconds * 1e3:.4g} ms (phases: {phases} ms; slowest: rank {self.slowest_rank} "
                f"{self.slowest_direction})")


def _accumulate(plan):
    """``(phase, sender, receiver, bytes, messages, local)`` per transfer kind, from the plan's
    groups, vectorised (no transfer is materialised); ``local`` marks local copies."""
    rows = []
    for g in plan.groups:
        nb = g.geo.numel * g.itemsize
        for tree, k in g.member_counts():
            rows.append((tree.phase, tree.sender, g.dst_rank, nb * k, np.full(nb.size, k, np.int64), g.is_local))
    if not rows:
        return None
    return tuple(np.concatenate(parts) for parts in zip(*rows))


def predict(plan, links: Links) -> TimePrediction:
    """The predicted publication time of ``plan`` on ``links`` (see the module doc)."""
    acc = _accumulate(plan)
    if acc is None:
        return TimePrediction(0.0, (), -1, "send")
    phase, snd, rcv, nbytes, msgs, local = acc
    P, R = int(phase.max()) + 1, int(max(snd.max(), rcv.max())) + 1
    send, recv, copy = np.zeros((P, R)), np.zeros((P, R)), np.zeros((P, R))
    np.add.at(copy, (phase[local], rcv[local]), nbytes[local] / links.local + msgs[local] * links.copy_latency)
    remote = ~local
    phase, snd, rcv, nbytes, msgs = phase[remote], snd[remote], rcv[remote], nbytes[remote], msgs[remote]
    inter = (snd // links.ranks_per_node) != (rcv // links.ranks_per_node)
    cost = nbytes / np.where(inter, links.inter, links.intra) + msgs * links.latency
    np.add.at(send, (phase, snd), cost)
    np.add.at(recv, (phase, rcv), cost)
    busy = (np.maximum(send, recv) if links.duplex else send + recv) + copy
    per_phase = busy.max(1)
    worst = int(np.argmax(per_phase))
    rank = int(np.argmax(busy[worst]))
    direction = "send" if send[worst, rank] >= recv[worst, rank] else "recv"
    return TimePrediction(float(per_phase.sum()), tuple(float(x) for x in per_phase), rank, direction)


_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def _rate(text: str, what: str) -> float:
    """``"400GB/s"``, ``"50g"``, ``"2.5e10"`` → bytes/s (a trailing ``b``/``B``/``/s`` is ignored)."""
    t = text.strip().lower().removesuffix("/s").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t)
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected a rate such as 400GB/s, 50g or 2.5e10") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}={text!r}: a bandwidth must be a finite rate > 0")
    return value * _UNITS[unit]


def parse_links(bandwidth: str, *, ranks_per_node: int = 8, latency: str = "0") -> Links:
    """``"intra=400GB/s,inter=50GB/s"`` (+ ``latency`` as ``"5us"``, ``"0.1ms"`` or seconds) → :class:`Links`."""
    parts = dict(item.split("=", 1) for item in bandwidth.split(",") if "=" in item)
    bad = sorted(set(parts) - {"intra", "inter"})
    if bad or not parts:
        raise ValueError(f"--bandwidth {bandwidth!r}: expected intra=…,inter=… (got {sorted(parts) or 'nothing'})")
    intra = _rate(parts.get("intra", parts.get("inter", "")), "intra")
    inter = _rate(parts.get("inter", parts.get("intra", "")), "inter")
    lat = latency.strip().lower()
    scale = 1e-6 if lat.endswith("us") else 1e-3 if lat.endswith("ms") else 1.0
    try:
        seconds = float(lat.removesuffix("us").removesuffix("ms").removesuffix("s")) * scale
    except ValueError:
        raise ValueError(f"--latency {latency!r}: expected e.g. 5us, 0.1ms or seconds") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"--latency {latency!r}: must be a finite time ≥ 0")
    if ranks_per_node < 1:
        raise ValueError(f"--gpus-per-node {ranks_per_node}: must be ≥ 1")
    return Links(intra, inter, seconds, ranks_per_node)
