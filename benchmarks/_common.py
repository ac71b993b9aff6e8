"""Shared helpers for the benchmark scripts: timing and appending a table to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def timeit(fn, *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def append_results(title: str, body: str) -> None:
    exe = os.path.relpath(sys.executable)
    exe = exe if exe.startswith(".venv") else "python"
    cmd = exe + " " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    env = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
           f"threads {torch.get_num_threads()}, {datetime.date.today()}")
    text = f"\n## {title}\n\n`{cmd}` — {env}\n\n{body}\n"
    with RESULTS.open("a") as f:
        f.write(text)
    print(text)
