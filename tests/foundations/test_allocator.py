"""The allocator's policy (hyperrl.allocator): freed memory kept for the next step — fewer page faults, applied by
``hyperrl.train`` unless ``run.keep_freed_memory=false``, never over the user's own malloc tuning. Each measurement
runs in its own process: the policy is process wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import hyperrl.allocator as allocator
import hyperrl.run as run
from hyperrl.allocator import MMAP_THRESHOLD_MAX, keep_freed_memory
from hyperrl.config import load_config

ROOT = Path(__file__).parents[2]
GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# a small training loop whose tensors (up to 10 MB) come and go each step, in three sizes; one torch thread
_LOOP = r"""
import resource, sys, torch
sys.path.insert(0, sys.argv[2])
torch.set_num_threads(1)
if sys.argv[1] == "1":
    from hyperrl.allocator import keep_freed_memory
    assert keep_freed_memory()
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
sizes = (3000, 5000, 4000)
def step(n):
    m(torch.randn(n, 128)).square().mean().backward()
for n in sizes:
    step(n)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(30):
    step(sizes[i % 3])
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 30)
"""


def _faults_per_step(keep: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in allocator.USER_TUNING and k != "GLIBC_TUNABLES"}
    r = subprocess.run([sys.executable, "-c", _LOOP, str(int(keep)), str(ROOT)], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return float(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_keeping_freed_memory_cuts_the_page_faults_of_a_repeated_step():
    # measured here, this loop: ≈ 3,250 minor faults a step with glibc's defaults, ≈ 300 with the policy
    default, kept = _faults_per_step(False), _faults_per_step(True)
    assert kept < 0.5 * default, (default, kept)


@pytest.mark.parametrize(("key", "bad"), [("mmap_threshold", -1), ("mmap_threshold", MMAP_THRESHOLD_MAX + 1),
                                          ("trim_threshold", -1), ("trim_threshold", 2**31), ("top_pad", -1),
                                          ("top_pad", 2**31)])
def test_a_threshold_out_of_range_is_refused_naming_it(key, bad):
    with pytest.raises(ValueError, match=f"{key}={bad}"):
        keep_freed_memory(**{key: bad})


class _Recorder:
    """A stand-in for glibc's mallopt that records its calls and answers ``ok`` to each."""

    def __init__(self, *ok: int):
        self.ok, self.calls = list(ok), []

    def __call__(self, param, value):
        self.calls.append((param, value))
        return self.ok.pop(0) if self.ok else 1


def test_the_users_own_malloc_tuning_is_kept(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(allocator, "_mallopt", lambda: rec)
    for var, value in (("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"), ("MALLOC_TRIM_THRESHOLD_", "0")):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert keep_freed_memory() is False
    assert rec.calls == []
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")  # not malloc's: applied
    assert keep_freed_memory() is True
    assert [p for p, _ in rec.calls] == [-3, -1, -2]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD


def test_a_refused_threshold_leaves_the_rest_alone_and_no_mallopt_changes_nothing(monkeypatch):
    for name in allocator.USER_TUNING + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    rec = _Recorder(0)  # musl's stub: refuses everything
    monkeypatch.setattr(allocator, "_mallopt", lambda: rec)
    assert keep_freed_memory() is False
    assert rec.calls == [(-3, allocator.MMAP_THRESHOLD)]
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)  # macOS, Windows
    assert keep_freed_memory() is False


def test_train_applies_the_policy_unless_the_run_turns_it_off(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(run, "keep_freed_memory", lambda: calls.append(True) or True)
    run.train(load_config(None, [f"--run.out_dir={tmp_path / 'a'}", "--run.steps=1", "--run.eval_every=0",
                                 "--run.export=false"]), progress=False)
    assert calls == [True]
    run.train(load_config(None, [f"--run.out_dir={tmp_path / 'b'}", "--run.steps=1", "--run.eval_every=0",
                                 "--run.export=false", "--run.keep_freed_memory=false"]), progress=False)
    assert calls == [True]
