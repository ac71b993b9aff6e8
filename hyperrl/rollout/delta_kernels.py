"""The CPU passes of a delta publication — find the changed elements, write them, checksum the tensor — each one
pass over the tensor in cache-sized steps, the steps split over a thread pool.

Why not torch's own ops: on the CPU ``torch.nonzero(new != base)`` writes a mask the size of the tensor and reads
it back, its index kernels are single passes of their own, and each is a separate sweep of memory; numpy's
comparison, ``flatnonzero``, fancy indexing and xxhash all release the GIL, so each step of :data:`BLOCK` bytes
is compared, indexed, written and hashed while it sits in cache, and the steps run on ``torch.get_num_threads()``
threads (or :func:`threads`' count). Measured side by side on this machine (2 cores; ``python
benchmarks/delta_kernels.py``, a 297 MiB bf16 embedding at 3 % changed): the scan 89 ms against 276 ms for torch's
whole-tensor passes + Adler-32 (3.1×), the checksum 9 ms against 86 ms (9.2×), the in-place write with its undo 25
ms against 135 ms (5.4×); benchmarks/delta.py has the end-to-end figures.

The checksum is xxh3-64 (the ``xxhash`` package) of the tensor's bytes by :data:`BLOCK`-byte blocks, then xxh3-64
of those digests (little-endian ``uint64``): blocks so that threads can hash them, and so that a step hashes the
bytes it has just compared or written — the block size is part of the format (fixed: sender and receiver agree
whatever their thread counts).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hyperrl.rollout.base import DeltaError

__all__ = ["BLOCK", "checksum", "scan", "swap", "threads"]

BLOCK = 2 << 20  # bytes per step and per checksum block (the checksum's format): a step's data stays in cache
_local = threading.local()


def _xxhash():
    """The ``xxhash`` module, or a :class:`DeltaError` saying how to install it."""
    try:
        import xxhash
    except ImportError:
        raise DeltaError("delta publication checksums tensors with xxh3 — the xxhash package is missing on this "
                         "process: `pip install xxhash` (hyperrl's train extra)") from None
    return xxhash


@contextlib.contextmanager
def threads(n: int):
    """Run this thread's kernels on ``n`` threads (1: in the calling thread, no pool) — a background job keeps
    off the pool the publication's own passes use."""
    before = getattr(_local, "threads", None)
    _local.threads = n
    try:
        yield
    finally:
        _local.threads = before


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per thread count (a process sees one or two counts)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="hyperrl-delta")


def _steps(n: int, item: int) -> list[tuple[int, int, int]]:
    """``(k, start, stop)`` element ranges of :data:`BLOCK` bytes covering ``n`` elements of ``item`` bytes."""
    size = max(BLOCK // item, 1)
    return [(k, s, min(s + size, n)) for k, s in enumerate(range(0, n, size))]


def _run(fn, steps: list) -> list:
    """``fn(group)`` over ``steps`` split into contiguous groups, one per thread; the groups' results
    concatenated in order."""
    workers = getattr(_local, "threads", None) or torch.get_num_threads()
    if workers <= 1 or len(steps) <= 1:
        return fn(steps)
    per = -(-len(steps) // workers)
    groups = [steps[i:i + per] for i in range(0, len(steps), per)]
    return [r for part in _pool(workers).map(fn, groups) for r in part]


def _combine(digests: list[int]) -> int:
    """The tensor's checksum from its blocks' digests, as a signed int64 (what an int64 header holds)."""
    h = _xxhash().xxh3_64_intdigest(np.asarray(digests, dtype="<u8").tobytes())
    return h - (1 << 64) if h >= 1 << 63 else h


def _check(name: str, a: np.ndarray) -> None:
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"delta kernels: {name} must be 1-D and contiguous, got shape {a.shape}")


def checksum(a: np.ndarray) -> int:
    """The checksum of a 1-D contiguous array's bytes (module doc)."""
    _check("the array", a)
    xxh = _xxhash().xxh3_64_intdigest
    return _combine(_run(lambda g: [xxh(a[s:e]) for _, s, e in g], _steps(a.size, a.itemsize)))


def scan(new: np.ndarray, base: np.ndarray, limit: int | None = None,
         index_dtype=np.int64) -> tuple[np.ndarray | None, np.ndarray | None, int, int]:
    """Where ``new`` and ``base`` (1-D, one dtype: bits) differ, in one pass: ``(indices, values, changed,
    checksum)`` — the flat indices (``index_dtype``, ascending), ``new``'s values there, how many, and
    :func:`checksum` of ``new``. Past ``limit`` changed elements (the caller sends the dense tensor then) only
    the count and the checksum: ``indices`` and ``values`` are None (memory stays bounded by ``limit``)."""
    _check("new", new)
    _check("base", base)
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"delta scan: new {new.shape} {new.dtype} against base {base.shape} {base.dtype}")
    cap = new.size if limit is None else limit
    xxh = _xxhash().xxh3_64_intdigest

    def group(g):
        mask, out, seen = np.empty(g[0][2] - g[0][1], dtype=bool), [], 0
        for _, s, e in g:
            m = np.not_equal(new[s:e], base[s:e], out=mask[:e - s])
            if seen <= cap:  # a group past the cap proves the whole tensor is: it only counts from then on
                i = np.flatnonzero(m)
                seen += i.size
                out.append((i.astype(index_dtype) + s, new[s:e][i], i.size, xxh(new[s:e])))
            else:
                out.append((None, None, int(np.count_nonzero(m)), xxh(new[s:e])))
        return out

    parts = _run(group, _steps(new.size, new.itemsize)) if new.size else []
    changed, check = sum(p[2] for p in parts), _combine([p[3] for p in parts])
    if changed > cap:
        return None, None, changed, check
    idx = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, dtype=index_dtype)
    return idx, (np.concatenate([p[1] for p in parts]) if parts else new[:0].copy()), changed, check


def swap(flat: np.ndarray, idx: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Write ``values`` at the flat indices ``idx`` of ``flat`` (1-D, contiguous) in place, in one pass: returns
    the old values there (the undo) and :func:`checksum` of the new ``flat`` — or ``None``, having written nothing,
    when ``idx`` is not strictly ascending within ``flat`` (the caller's general path then applies it, or names the
    bad index). ``values``: one per index, of ``flat``'s dtype (checked before anything is written)."""
    _check("the tensor", flat)
    if idx.ndim != 1 or values.shape != idx.shape or values.dtype != flat.dtype:
        raise DeltaError(f"{idx.size} indices and {values.size} values of {values.dtype} for a tensor of "
                         f"{flat.dtype}: a delta needs one value of the tensor's dtype per index")
    n = flat.size
    if idx.size and (idx[0] < 0 or idx[-1] >= n or not bool(np.all(idx[1:] > idx[:-1]))):
        return None
    steps = _steps(n, flat.itemsize)
    # the steps' bounds in idx's own dtype: other keys would make numpy cast (copy) all of idx first
    cut = np.searchsorted(idx, np.asarray([s for _, s, _ in steps] + [n], dtype=idx.dtype))
    old, xxh = np.empty_like(values), _xxhash().xxh3_64_intdigest

    def group(g):
        out = []
        for k, s, e in g:
            a, b = cut[k], cut[k + 1]
            if b > a:
                loc, part = idx[a:b] - s, flat[s:e]
                old[a:b] = part[loc]
                part[loc] = values[a:b]
            out.append(xxh(flat[s:e]))
        return out

    return old, _combine(_run(group, steps))
