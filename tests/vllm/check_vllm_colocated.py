"""The colocated topology: ``torchrun --nproc-per-node 2`` of tests/vllm/colocated_train.py (a TP 2 trainer whose
ranks each host one worker of a vLLM TP 2 engine, in process), its per-rank reports collected."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _torchrun(nproc: int, steps: int, *extra: str) -> list[dict]:
    out = tempfile.mkdtemp()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    r = subprocess.run([torchrun, "--nproc-per-node", str(nproc), "--master-port", "29533",
                        str(HERE / "colocated_train.py"), str(steps), *extra], capture_output=True, text=True,
                       timeout=900, cwd=HERE.parents[1], env={**os.environ, "HYPERRL_OUT": out,
                                                              "PYTHONPATH": str(HERE.parents[1])})
    # the ranks share stdout: another rank's log may follow a report on its line — read the JSON object only
    dec = json.JSONDecoder()
    ranks = [dec.raw_decode(ln[len("RESULT "):])[0] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or len(ranks) != nproc:
        raise RuntimeError(f"torchrun failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return sorted(ranks, key=lambda x: x["rank"])


def run(steps: int = 40) -> dict:
    """One engine over 2 ranks (``steps`` steps), then two replicas over 4 ranks fed by the fan-out tree (6 steps)."""
    return {"ranks": _torchrun(2, steps), "replicas": _torchrun(4, 6, "--rollout.fan_out=true")}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 40)))
    sys.stdout.flush()
