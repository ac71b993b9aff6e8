"""The colocated topology: ``torchrun --nproc-per-node 2`` of tests/vllm/colocated_train.py (a TP 2 trainer whose
ranks each host one worker of a vLLM TP 2 engine, in process), its per-rank reports collected."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(steps: int = 40) -> dict:
    out = tempfile.mkdtemp()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29533",
                        str(HERE / "colocated_train.py"), str(steps)], capture_output=True, text=True, timeout=900,
                       cwd=HERE.parents[1], env={**os.environ, "HYPERRL_OUT": out,
                                                 "PYTHONPATH": str(HERE.parents[1])})
    ranks = [json.loads(ln[len("RESULT "):]) for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or len(ranks) != 2:
        raise RuntimeError(f"torchrun failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return {"ranks": sorted(ranks, key=lambda x: x["rank"])}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 40)))
    sys.stdout.flush()
