"""Bucketing a plan under a per-rank staging cap (first-fit decreasing, as slime does)."""

from __future__ import annotations

from collections import defaultdict

from hyperrl.sharding.spec import Box
from hyperrl.sharding.transfer import Transfer

__all__ = ["bucketize", "split_transfer"]


def split_transfer(t: Transfer, max_bytes: int) -> list[Transfer]:
    """Split ``t`` into pieces of at most ``max_bytes`` along its outermost splittable dim."""
    if t.nbytes <= max_bytes:
        return [t]
    per_elem = t.nbytes // max(_numel(t.dst_slice.sizes), 1)
    if per_elem > max_bytes:
        raise ValueError(f"max_bytes={max_bytes} is smaller than one element ({per_elem} B) of {t.tensor}")
    sizes = t.dst_slice.sizes
    d = next(i for i, s in enumerate(sizes) if s > 1)
    row = t.nbytes // sizes[d]  # bytes of one slice along d
    if row > max_bytes:  # one slice along d is still too big: split each slice further
        out = []
        for i in range(sizes[d]):
            out += split_transfer(_narrow(t, d, i, 1, row), max_bytes)
        return out
    step = max(max_bytes // row, 1)
    return [_narrow(t, d, i, min(step, sizes[d] - i), row) for i in range(0, sizes[d], step)]


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _narrow_box(b: Box, d: int, start: int, length: int) -> Box:
    offs, sizes = list(b.offsets), list(b.sizes)
    offs[d] += start
    sizes[d] = length
    return Box(tuple(offs), tuple(sizes))


def _narrow(t: Transfer, d: int, start: int, length: int, row: int) -> Transfer:
    extra = len(t.dst_slice.sizes) - len(t.src_slice.sizes)
    dst = _narrow_box(t.dst_slice, d, start, length)
    src = t.src_slice if d < extra else _narrow_box(t.src_slice, d - extra, start, length)
    return t._replace(src_slice=src, dst_slice=dst, nbytes=row * length)


def bucketize(transfers: list[Transfer], max_bytes: int) -> list[list[Transfer]]:
    """Group transfers into buckets so that no rank stages more than ``max_bytes`` to send or to
    receive in one bucket. First-fit decreasing; oversized transfers are split first; the forwards
    of fan-out phase k go in buckets after every bucket of phase k − 1 (their data must have arrived)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes}: must be > 0")
    out: list[list[Transfer]] = []
    for phase in sorted({t.phase for t in transfers}):
        items = [p for t in transfers if t.phase == phase for p in split_transfer(t, max_bytes)]
        items.sort(key=lambda t: (-t.nbytes, t.src_rank, t.dst_rank, t.tensor, t.dst_slice.offsets))
        buckets: list[list[Transfer]] = []
        sent: list[dict] = []
        recv: list[dict] = []
        for t in items:
            for b, s, r in zip(buckets, sent, recv):
                if s[t.src_rank] + t.nbytes <= max_bytes and r[t.dst_rank] + t.nbytes <= max_bytes:
                    b.append(t)
                    s[t.src_rank] += t.nbytes
                    r[t.dst_rank] += t.nbytes
                    break
            else:
                buckets.append([t])
                sent.append(defaultdict(int, {t.src_rank: t.nbytes}))
                recv.append(defaultdict(int, {t.dst_rank: t.nbytes}))
        out += buckets
    return out
