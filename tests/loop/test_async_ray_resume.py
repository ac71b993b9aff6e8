"""The gated asynchronous schedule on Ray, killed with SIGKILL and resumed, the way a user meets it: ``hyperrl
train`` in its own process starting its own Ray, ``kill -9`` of that process mid-run, the same command again. The
checkpoint carries the ready batches an older version generated (the resumed weights cannot make them again), so the
resumed run is the uninterrupted run bit for bit — every step's record and the final weights."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from hyperrl.loop.checkpoint import latest_checkpoint, read_state

# one Ray instance at a time (README: --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.ray, pytest.mark.slow]

# what depends on timing, not on what was generated and trained
_TIMING = {"tokens_per_s", "async_admitted", "async_in_flight", "async_ready"}


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "hyperrl.cli", "train", "--task=modsum", "--rollout.max_new_tokens=16",
            f"--run.out_dir={out}", "--run.eval_every=0", "--rollout.prompts_per_step=4", "--rollout.n=4",
            "--run.threads=1", "--async.max_staleness=2", "--async.schedule=gated",
            "--async.executor={name: ray, workers: 1, num_cpus: 1}", "--run.steps=9", "--run.ckpt_every=3",
            "--run.export=false"]


def _records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in _TIMING} for r in rows
            if r["event"] == "step"]


def _run(out: Path) -> None:
    r = subprocess.run(_cmd(out), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_gated_ray_run_killed_with_sigkill_resumes_bit_identical(tmp_path):
    out, ck = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    proc = subprocess.Popen(_cmd(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not (ck / "step_3").is_dir():  # training, a checkpoint written
        assert time.monotonic() < deadline, "the run wrote no checkpoint in 300 s"
        time.sleep(0.01)
    ray_procs = psutil.Process(proc.pid).children(recursive=True)  # the Ray this run started, its actor
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = latest_checkpoint(ck)
    assert resumed_from.name != "step_9", "the run ended before it was killed: the test would prove nothing"
    kept = read_state(resumed_from)["async"]["ready"]
    assert kept and all(r["version"] < read_state(resumed_from)["version"] for r in kept)  # made by older weights

    _run(out)  # the same command: resumes from the newest checkpoint
    _run(tmp_path / "ref")  # the uninterrupted run
    assert [r["step"] for r in _records(out)] == list(range(1, 10))
    assert _records(out) == _records(tmp_path / "ref")
    wa, wb = (load_file(latest_checkpoint(o / "checkpoints") / "model.safetensors") for o in (out, tmp_path / "ref"))
    assert wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)

    # Ray's own processes outlive a SIGKILLed driver for a while (Ray 2.58's agents wait ~1 min on the dead GCS
    # before they exit): none of them is left for good
    gone, alive = psutil.wait_procs(ray_procs, timeout=150)
    for p in alive:
        os.kill(p.pid, signal.SIGKILL)
    assert not alive, [p.pid for p in alive]
