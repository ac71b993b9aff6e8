"""Reproducible at default settings, the way a user meets it: separate processes, the default thread
count, and runs killed with SIGKILL at random moments then resumed."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hyperrl.loop.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.slow]

# the default batch (32 prompts × 16) and model; no --run.threads: torch's default thread count
_ARGS = ["--run.eval_every=4", "--run.eval_prompts=32"]


def _cmd(out: Path, steps: int, *extra) -> list[str]:
    return [sys.executable, "-m", "hyperrl.cli", "train", f"--run.out_dir={out}", f"--run.steps={steps}", *_ARGS,
            *extra]


def _env():
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # pytest-xdist workers must not pin the thread count for this test
    return env


def _records(out: Path) -> list[dict]:
    """The step and evaluation records (a resumed run also records its ``resume`` events)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k != "tokens_per_s"} for r in rows
            if r["event"] in ("step", "eval")]


def _weights(out: Path) -> dict:
    return load_file(latest_checkpoint(out / "checkpoints") / "model.safetensors")


def _same(a: Path, b: Path) -> None:
    from hyperrl.diff import diff_runs

    assert _records(a) == _records(b)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    d = diff_runs(a, b)  # every step's fingerprints too: rows, rewards, advantages, loss terms, weights
    assert d.step is None and d.versions == {} and d.steps[0] == d.steps[1], d


def test_two_processes_at_the_default_thread_count_agree_bit_for_bit(tmp_path):
    for name in ("a", "b"):
        r = subprocess.run(_cmd(tmp_path / name, 6), capture_output=True, text=True, timeout=600, env=_env())
        assert r.returncode == 0, r.stderr[-3000:]
    _same(tmp_path / "a", tmp_path / "b")


def test_sigkill_at_random_moments_then_resume_ends_identical(tmp_path):
    steps = 10
    ref = subprocess.run(_cmd(tmp_path / "ref", steps), capture_output=True, text=True, timeout=600, env=_env())
    assert ref.returncode == 0, ref.stderr[-3000:]
    out, rng, kills, torn = tmp_path / "k", random.Random(0), 0, 0
    ckdir = out / "checkpoints"
    while True:
        proc = subprocess.Popen(_cmd(out, steps, "--run.ckpt_every=1"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=_env())
        if kills < 4:
            deadline = time.monotonic() + 120
            start = len(list(ckdir.glob("step_*"))) if ckdir.exists() else 0
            while proc.poll() is None and time.monotonic() < deadline:  # wait until it is training
                if ckdir.exists() and len(list(ckdir.glob("step_*"))) > start:
                    break
                time.sleep(0.002)
            if kills == 0:  # the first kill lands while a checkpoint is being written
                while proc.poll() is None and not list(ckdir.glob("step_*.tmp")):
                    time.sleep(0.0005)
            else:
                time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                torn += bool(list(ckdir.glob("step_*.tmp")))
                continue
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
        if proc.returncode == 0 and latest_checkpoint(ckdir).name == f"step_{steps}":
            break
    assert kills >= 3, kills  # the run really was interrupted (a torn write among them: {torn})
    _same(tmp_path / "ref", out)
