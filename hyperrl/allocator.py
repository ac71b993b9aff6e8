"""The host allocator's policy for a training process: keep freed memory for the next step.

A step allocates and frees the same few-megabyte tensors (activations, gradients, logits) every time. glibc's
``malloc`` serves blocks above its mmap threshold with fresh ``mmap`` pages and hands the top of the heap back to
the system above its trim threshold, so each step faults its pages in again — 700–1,500 minor page faults a step at
the default job, against 2–4 with the thresholds below (``benchmarks/RESULTS.md``). This is what PyTorch's CPU
performance guide gets by preloading jemalloc or tcmalloc; glibc's own ``mallopt`` does it without a library (none
to install, nothing preloaded). Numbers are unchanged bit for bit: only where the memory comes from changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "TOP_PAD"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (glibc's own dynamic threshold stops at 32 MiB)
TRIM_THRESHOLD = 1 << 30  # the heap's free top is kept up to 1 GiB instead of returned to the system
TOP_PAD = 64 << 20  # the heap grows 64 MiB at a time


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD,
                      top_pad: int = TOP_PAD) -> bool:
    """Set glibc's ``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD`` and ``M_TOP_PAD`` for this process (bytes); process
    wide and kept until exit. → True when set; False where there is no glibc ``mallopt`` (macOS, musl): nothing
    changes there. The cost: up to ``trim_threshold`` of freed heap stays with the process."""
    for name, v in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold), ("top_pad", top_pad)):
        if not 0 <= v < 2**31:
            raise ValueError(f"{name}={v}: bytes in [0, 2**31) (mallopt takes a C int)")
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = [mallopt(p, v) == 1 for p, v in ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold),
                                            (_M_TOP_PAD, top_pad))]
    return all(done)
