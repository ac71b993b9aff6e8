"""The planner of an earlier commit vs this checkout, side by side (appended to RESULTS.md).

DeepSeek-V3 fsdp64 × ep16 (1,024 trainer ranks) → tp8 × dp32 (256 rollout ranks), 45,395 tensors:
each side runs in its own subprocess (fresh imports), builds fresh layouts and plans three times,
without and with the fan-out tree; then the CLI itself (``hyperrl plan … --json``, its own ``plan_s``,
a fresh process: what a user sees) without and with ``--fan-out``. The sides alternate ``--pairs`` times,
so machine noise hits both alike. Quotes the medians and the ratios; checks both commits' plans have the
same transfer count and the same bytes (wire = B_recv_min; with fan-out, egress = B_src_min).

    python benchmarks/plan_vs_commit.py --ref ac46f0f [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402

_CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from hyperrl.sharding import reshard_plan
from hyperrl.sharding.models import MODELS, trainer_layout
try:
    from hyperrl.sharding.vllm import rollout_layout
except ImportError:  # before the sharding modules were split
    from hyperrl.sharding.models import rollout_layout
cfg, out = MODELS["deepseek-v3"], {}
for fan in (False, True):
    ts = []
    for _ in range(3):
        src, dst = trainer_layout(cfg, fsdp=64, ep=16), rollout_layout(cfg, offset=1024, tp=8, dp=32)
        t0 = time.perf_counter()
        plan = reshard_plan(src, dst, fan_out=fan)
        ts.append(time.perf_counter() - t0)
    s = plan.stats()
    out[str(fan)] = {"median": statistics.median(ts), "transfers": len(plan),
                     "bytes": [s.wire_bytes, s.recv_min_bytes, s.egress_bytes, s.src_min_bytes],
                     "minimal": s.wire_bytes == s.recv_min_bytes and (not fan or s.egress_bytes == s.src_min_bytes)}
print(json.dumps(out))
"""

_CLI = ["-m", "hyperrl.cli", "plan", "--model", "deepseek-v3", "--trainer", "fsdp=64,ep=16", "--rollout", "tp=8,dp=32",
        "--json"]


def _run(tree: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tree)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli(tree: Path, fan: bool) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, *_CLI, *(["--fan-out"] if fan else [])], capture_output=True, text=True,
                         check=True, cwd=tree, env=env)
    return json.loads(out.stdout)["plan_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="the earlier commit (any git ref)")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    runs: dict = {"old": [], "new": []}
    cli: dict = {(side, fan): [] for side in ("old", "new") for fan in (False, True)}
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old), args.ref], check=True,
                       capture_output=True)
        try:
            for _ in range(args.pairs):
                for side, tree in (("old", old), ("new", ROOT)):
                    runs[side].append(_run(tree))
                    for fan in (False, True):
                        cli[(side, fan)].append(_cli(tree, fan))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
    rows = []
    for fan in ("False", "True"):
        a = [r[fan] for r in runs["old"]]
        b = [r[fan] for r in runs["new"]]
        assert all(x["transfers"] == b[0]["transfers"] and x["bytes"] == b[0]["bytes"] and x["minimal"]
                   for x in a + b), (a, b)
        ma, mb = statistics.median(x["median"] for x in a), statistics.median(x["median"] for x in b)
        what = "fan-out tree" if fan == "True" else "direct"
        rows.append([f"in process, {what}", round(ma, 3), round(mb, 3), f"{ma / mb:.2f}×"])
        ca, cb = statistics.median(cli[("old", fan == "True")]), statistics.median(cli[("new", fan == "True")])
        rows.append([f"CLI plan_s, {what}", round(ca, 3), round(cb, 3), f"{ca / cb:.2f}×"])
    body = table(["DeepSeek-V3 fsdp64×ep16 → tp8×dp32", f"{args.ref} s", "this checkout s", "speed-up"], rows)
    body += (f"\n\n(medians over {args.pairs} alternating pairs of processes; in process: the median of 3 plans from "
             "fresh layouts; the transfers and every byte figure equal between the commits — wire = B_recv_min, "
             "and with the tree egress = B_src_min)")
    print(body)
    append_results(f"planner: {args.ref} vs this checkout, DeepSeek-V3 1,024 → 256 ranks", body)


if __name__ == "__main__":
    main()
