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


def run_child(code: str, *args, cwd) -> dict:
    """Run ``code`` in a fresh Python process (``python -c code *args`` in ``cwd``) and return the JSON object its
    last stdout line holds — a measurement no earlier allocation of this process can colour (peak RSS)."""
    import json
    import subprocess

    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


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


def _pin_ray_system(cores: set[int]) -> None:
    """Move the processes ``ray.init`` started (GCS, raylet, their helpers) and every thread of
    them onto ``cores`` — the rollout worker's — so they never take the learner's core."""
    import os

    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            for t in child.threads():
                os.sched_setaffinity(t.id, cores)
        except (psutil.Error, OSError):  # a helper that exited meanwhile
            pass


def start_pinned_ray(threads: int) -> set[int]:
    """This process (the learner) on cores ``[0, threads)``; a local Ray (1 CPU) whose own processes go on
    ``[threads, 2·threads)`` — the rollout worker's cores, returned."""
    import ray

    learner, rollout = set(range(threads)), set(range(threads, 2 * threads))
    os.sched_setaffinity(0, learner)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    _pin_ray_system(rollout)
    return rollout


def pin_actor(trainer, rollout: set[int]) -> None:
    """Every thread of the trainer's Ray rollout actor (its calls run on a thread pool), and whatever Ray
    started for it, onto ``rollout``."""
    import ray

    def pin(actor):
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), rollout)

    ray.get(trainer.collector.workers[0].actor.__ray_call__.remote(pin))
    _pin_ray_system(rollout)


def synthetic_update_batch(rows: int, response: int, prompt: int = 8, vocab: int = 20):
    """A GRPO-ready rollout batch for one update: ``rows`` samples of one ``prompt``-token prompt, each with a
    ``response``-token response (ids in ``[3, vocab)``, rollout log-probs −3, random rewards), advantages
    computed — what the memory benchmarks feed ``trainer.prepare`` + ``trainer.update``."""
    import hyperrl.transforms as T
    from hyperrl.trajectory import make_trajectory

    g = torch.Generator().manual_seed(0)
    tokens = torch.cat([torch.randint(3, vocab, (1, prompt), generator=g).repeat(rows, 1),
                        torch.randint(3, vocab, (rows, response), generator=g)], 1)
    act = torch.arange(prompt + response)[None, :].expand(rows, -1) >= prompt
    batch = make_trajectory(tokens=tokens, attention_mask=torch.ones_like(act), action_mask=act,
                            rollout_logprobs=torch.full((rows, prompt + response), -3.0) * act,
                            group_id=torch.zeros(rows, dtype=torch.long),
                            policy_version=torch.zeros(rows, dtype=torch.long), reward=torch.rand(rows, generator=g))
    return T.compute_advantages(batch, "grpo")
