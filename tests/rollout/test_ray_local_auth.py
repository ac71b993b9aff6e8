"""A local Ray instance started by hyperrl requires Ray's token authentication: its own actors run,
a process without the token cannot connect (Ray 2.58's servers listen on every interface)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.ray, pytest.mark.slow]

SCRIPT = """
import os, subprocess, sys
from hyperrl.rollout.workers.ray_executor import _local_ray, _token_auth

if sys.argv[1] == "before":  # Ray imported (and run) in this process before hyperrl could ask for auth
    import ray
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    ray.shutdown()
auth = _token_auth()
import ray
_local_ray(1, auth=auth)

@ray.remote
def f():
    return 41 + 1

print("MODE", os.environ.get("RAY_AUTH_MODE"), "ACTOR", ray.get(f.remote(), timeout=120), flush=True)
addr = ray.get_runtime_context().gcs_address
env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
probe = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{addr}'); print('IN')"],
                       capture_output=True, text=True, timeout=120, env=env)
print("INTRUDER", "IN" in probe.stdout, flush=True)
ray.shutdown()
"""


@pytest.mark.parametrize("first", ["fresh", "before", "stale"])
def test_a_local_ray_instance_refuses_a_process_without_its_token(tmp_path, first):
    """``stale``: Ray's temp dir names another cluster in ``ray_current_cluster`` (``ray start`` or
    ``ray.cluster_utils.Cluster`` writes it — another test's cluster, CI once ran one beside the vLLM check);
    a bare ``ray.init(num_cpus=…)`` would try to join it and refuse ``num_cpus``: hyperrl's local instance
    is its own all the same."""
    script = tmp_path / "local_ray.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="rt") as ray_tmp:  # short: Ray's socket paths
        if first == "stale":
            Path(ray_tmp, "ray").mkdir()  # Ray's temp dir is $RAY_TMPDIR/ray
            Path(ray_tmp, "ray", "ray_current_cluster").write_text("127.0.0.1:1")
            env["RAY_TMPDIR"] = ray_tmp
        out = subprocess.run([sys.executable, str(script), first], capture_output=True, text=True, timeout=400,
                             cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    if first in ("fresh", "stale"):
        assert "MODE token ACTOR 42" in out.stdout and "INTRUDER False" in out.stdout, out.stdout
    else:  # Ray caches the mode per process: it falls back, and says so
        assert "MODE None ACTOR 42" in out.stdout and "without token authentication" in out.stderr, out.stdout


def test_a_run_on_the_ray_it_started_exits_when_done(tmp_path):
    # the collector is closed at the run's end and again when it is collected: the second close must not call Ray
    # (whose auto-init would start it again — at interpreter exit, a hang: the agent units' threads keep the collector
    # alive until then)
    args = [sys.executable, "-m", "hyperrl.cli", "train", "--config=configs/calculator_agent.yaml",
            "--model.hidden=32", "--model.intermediate=64",
            "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.steps=2", "--run.eval_every=0",
            f"--run.out_dir={tmp_path}", "--async.max_staleness=1",
            "--async.executor={name: ray, workers: 1, num_cpus: 1, threads: 1}"]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the run did not exit: {(e.stderr or b'')[-800:]!r}") from None
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: 2 steps" in proc.stdout + proc.stderr
