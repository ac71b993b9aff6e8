"""Learning of ``hyperrl train`` (no other arguments) over seeds: held-out reward at chosen steps.

Runs ``hyperrl train --run.seed=S`` in its own process for each seed, reads ``metrics.jsonl`` and
appends a table to RESULTS.md (the target: ≥ 0.9 held-out at step 1,000 on 5/5 seeds).

    python benchmarks/seeds.py --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--at", type=int, nargs="+", default=[200, 400, 1000])
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides, e.g. --extra=--algo.recipe=dapo")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.seeds:
            out = Path(tmp) / f"seed{s}"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", f"--run.seed={s}", f"--run.out_dir={out}",
                            *args.extra], check=True, capture_output=True)
            wall = time.perf_counter() - t0
            evals = {r["step"]: r["eval_reward_mean"] for r in map(json.loads, (out / "metrics.jsonl").open())
                     if r["event"] == "eval"}
            rows.append([s, *[evals.get(k, "") for k in args.at], round(wall, 1)])
    ok = sum(1 for r in rows if isinstance(r[len(args.at)], float) and r[len(args.at)] >= 0.9)
    append_results("learning over seeds (hyperrl train, defaults)",
                   f"`hyperrl train --run.seed=S {' '.join(args.extra)}`, held-out reward (256 prompts) at steps "
                   f"{args.at}; {ok}/{len(rows)} seeds ≥ 0.9 at step {args.at[-1]}:\n\n"
                   + table(["seed", *[f"step {k}" for k in args.at], "wall s (incl. start-up)"], rows))


if __name__ == "__main__":
    main()
