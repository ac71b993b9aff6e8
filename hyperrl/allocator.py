"""The host allocator's policy for a training process: keep freed memory for the next step.

A step allocates and frees the same few-megabyte tensors (activations, gradients, logits) every time. glibc's
``malloc`` serves blocks above its mmap threshold with fresh ``mmap`` pages and hands the top of the heap back to
the system above its trim threshold, so each step faults its pages in again — 70–1,650 minor page faults a step at
the default job, against 2–7 with the thresholds below (``benchmarks/RESULTS.md``). This is what PyTorch's CPU
performance guide gets by preloading jemalloc or tcmalloc; glibc's own ``mallopt`` does it without a library (none
to install, nothing preloaded). Numbers are unchanged bit for bit: only where the memory comes from changes.
Blocks above 32 MiB (glibc's cap on the threshold; a large vocabulary's logits) are still mapped afresh each time,
as glibc's own dynamic threshold, which stops at the same 32 MiB, leaves them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "TOP_PAD", "MMAP_THRESHOLD_MAX", "USER_TUNING"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = MMAP_THRESHOLD_MAX  # blocks below this come from the heap
TRIM_THRESHOLD = 1 << 30  # the heap's free top is kept up to 1 GiB instead of returned to the system
TOP_PAD = 64 << 20  # the heap grows 64 MiB at a time
# the environment variables through which a user tunes glibc's malloc: set, they are the user's choice and kept
USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def _mallopt():
    """glibc's ``mallopt`` from the running process's C library (None: no C library exports it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD,
                      top_pad: int = TOP_PAD) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD`` and ``M_TOP_PAD`` for this process (bytes; see the
    module doc); process wide and kept until exit. → True when all three are set. False, with nothing changed,
    where there is no glibc ``mallopt`` (macOS, Windows; musl's is a stub), where the user tunes malloc already
    (``GLIBC_TUNABLES`` with ``glibc.malloc.*``, or a ``MALLOC_*_`` variable of :data:`USER_TUNING`), or where
    glibc refuses the mmap threshold (then the other two are left alone). The cost: up to ``trim_threshold`` of
    freed heap top, plus ``top_pad``, stays with the process, beside what glibc keeps anyway (free blocks inside
    the heap)."""
    if not 0 <= mmap_threshold <= MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold={mmap_threshold}: bytes in [0, {MMAP_THRESHOLD_MAX}] (glibc's cap on "
                         "64-bit)")
    for name, v in (("trim_threshold", trim_threshold), ("top_pad", top_pad)):
        if not 0 <= v < 2**31:
            raise ValueError(f"{name}={v}: bytes in [0, 2**31) (mallopt takes a C int)")
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(k in os.environ for k in USER_TUNING):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    for param, v in ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad)):
        if mallopt(param, v) != 1:  # the first refused: the rest untouched (musl's stub refuses the first)
            return False
    return True
