"""Agent rounds under a stop signal (issue 55, item 7): a real ``hyperrl train`` process whose CLI agents hang is
sent SIGTERM mid-round — the round ends at once (not after ``env.timeout_s``), its episodes are cancelled, a
checkpoint of the last finished step is written and the run exits 143; the rerun resumes and the agents' processes
are gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agents.test_programs import processes_with

ROOT = Path(__file__).resolve().parents[2]

AGENT = '''
import os, subprocess, sys, time
from openai import OpenAI
marker, flag = sys.argv[1], sys.argv[2]
OpenAI(max_retries=0).chat.completions.create(model="hyperrl-policy", messages=[{"role": "user", "content": "hi"}])
if os.path.exists(flag):  # from step 2 on: a child that sleeps, and the agent hangs
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker])
    open(flag + ".hung", "w").close()
    time.sleep(300)
print("ok")
'''


@pytest.mark.slow
def test_sigterm_mid_agent_round_cancels_it_checkpoints_and_exits(tmp_path):
    marker, flag = f"sigterm-agent-{os.getpid()}-{time.time_ns()}", tmp_path / "hang"
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "judge.py").write_text("def judge(sample, result):\n    return float(result.exit_code == 0)\n")
    (tmp_path / "cfg.yaml").write_text(f"""
task: {{name: products}}
env: {{name: agent, command: ["{sys.executable}", "{tmp_path}/agent.py", "{marker}", "{flag}"],
      reward: "{tmp_path}/judge.py:judge", timeout_s: 300}}
model: {{hidden: 32, intermediate: 64}}
rollout: {{prompts_per_step: 2, n: 2, max_new_tokens: 6}}
run: {{steps: 4, eval_every: 0, ckpt_every: 1, out_dir: "{tmp_path}/run", threads: 1, export: false}}
""")
    cmd = [sys.executable, "-m", "hyperrl.cli", "train", "--config", str(tmp_path / "cfg.yaml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "checkpoints" / "step_1").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        flag.touch()  # the next round's agents hang
        while not Path(f"{flag}.hung").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        assert Path(f"{flag}.hung").exists(), "no agent of step 2 started"
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert took < 30, f"the round took {took:.0f} s to end after SIGTERM"
    done = max(int(p.name[5:]) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name[5:].isdigit())
    assert done in (1, 2)  # the agents hang from the step after the flag (step 2, or 3 if step 2 was under way)
    assert "the agent round was cancelled (SIGTERM)" in err and f"step {done + 1} is generated again" in err, err
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with(marker), "an agent's process outlived the cancelled round"
    flag.unlink()  # the rerun's agents answer: it resumes and finishes
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from step {done}" in res.stdout
    # the run's records serve the tools: every step's fingerprints (the resumed steps written again, once), its
    # trace, and the doctor on its agent rows (the last kept step with the weights that trained it)
    from hyperrl.cli import main
    from hyperrl.loop.fingerprints import read_fingerprints

    run = tmp_path / "run"
    assert sorted(read_fingerprints(run).steps) == [1, 2, 3, 4]
    assert main(["diff", str(run), str(run)]) == 0
    assert main(["trace", str(run)]) == 0 and (run / "trace.json").is_file()
    assert main(["doctor", str(run)]) == 0
