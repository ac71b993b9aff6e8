"""The planner of an earlier commit vs this checkout, side by side (appended to RESULTS.md).

DeepSeek-V3 fsdp64 × ep16 (1,024 trainer ranks) → tp8 × dp32 (256 rollout ranks), 45,395 tensors:
each side runs in its own subprocess (fresh imports), builds fresh layouts and plans three times;
the sides alternate ``--pairs`` times, so machine noise hits both alike. Quotes the median of
each and the ratio; checks both plans have the same transfer count and wire = B_recv_min.

    python benchmarks/plan_vs_commit.py --ref ac46f0f [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
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
cfg, ts = MODELS["deepseek-v3"], []
for _ in range(3):
    src, dst = trainer_layout(cfg, fsdp=64, ep=16), rollout_layout(cfg, offset=1024, tp=8, dp=32)
    t0 = time.perf_counter()
    plan = reshard_plan(src, dst)
    ts.append(time.perf_counter() - t0)
s = plan.stats()
print(json.dumps({"median": statistics.median(ts), "transfers": len(plan),
                  "minimal": s.wire_bytes == s.recv_min_bytes}))
"""


def _run(tree: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tree)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="the earlier commit (any git ref)")
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(old), args.ref], check=True,
                       capture_output=True)
        try:
            rows = []
            for i in range(args.pairs):
                a, b = _run(old), _run(ROOT)
                assert a["transfers"] == b["transfers"] and a["minimal"] and b["minimal"], (a, b)
                rows.append([i + 1, round(a["median"], 3), round(b["median"], 3), f"{a['median'] / b['median']:.2f}×"])
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
    body = table(["pair", f"{args.ref} s", "this checkout s", "ratio"], rows)
    print(body)
    append_results(f"planner: {args.ref} vs this checkout, DeepSeek-V3 1,024 → 256 ranks (median of 3 each, "
                   "alternating)", body)


if __name__ == "__main__":
    main()
