"""Learning of ``hyperrl train`` (no other arguments) over seeds: a held-out metric at chosen steps.

Runs ``hyperrl train --run.seed=S`` in its own process for each seed (one at a time: it uses the
machine's cores), reads ``metrics.jsonl`` and appends a table to RESULTS.md: the metric
(default the arith task's held-out exact match) at each step of ``--at`` and the training time
until it first reached ``--target``.

    python benchmarks/seeds.py --seeds 0 1 2 3 4
    python benchmarks/seeds.py --metric eval_reward_mean --at 200 400 1000 --extra=--task=modsum \
        --extra=--rollout.max_new_tokens=1 --extra=--run.steps=1000
    python benchmarks/seeds.py --metric eval_success_rate --target 0.5 --floor 0.9 --at 100 200 300 400 500 \
        --extra=--config=configs/calculator.yaml     # the tool-use task
    python benchmarks/seeds.py --seeds 0 1 2 --metric eval_reward_passed_mean --target 0.8 --at 500 1000 1500 2000 \
        --keep /tmp/code-seeds --extra=--config=configs/code.yaml   # the code task (then benchmarks/code_answers.py)
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
    ap.add_argument("--at", type=int, nargs="+", default=[500, 1000, 1500])
    ap.add_argument("--metric", default="eval_reward_exact_answer_mean", help="the held-out metric to report")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--floor", type=float, default=0.8, help="also count the seeds at or above this at the last step")
    ap.add_argument("--keep", type=Path, default=None, help="keep each seed's run in KEEP/seedS (e.g. for "
                    "benchmarks/code_answers.py) instead of a temporary directory")
    ap.add_argument("--extra", action="extend", nargs="*", default=[],
                    help="more overrides (repeatable), e.g. --extra=--algo.recipe=dapo --extra=--run.steps=500")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.seeds:
            out = (args.keep or Path(tmp)) / f"seed{s}"
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", f"--run.seed={s}", f"--run.out_dir={out}",
                            *args.extra], check=True, capture_output=True)
            wall = time.perf_counter() - t0
            recs = [json.loads(line) for line in (out / "metrics.jsonl").open()]
            evals = {r["step"]: r.get(args.metric) for r in recs if r["event"] == "eval"}
            # training seconds until the metric first reached the target (generation + update + publish)
            spent, reached = 0.0, None
            for r in recs:
                if r["event"] == "step":
                    spent += sum(v for k, v in r.items() if k.startswith("time_") and k.endswith("_s"))
                elif r.get(args.metric) is not None and r[args.metric] >= args.target and reached is None:
                    reached = round(spent, 1)
            rows.append([s, *[evals.get(k, "") for k in args.at], reached if reached is not None else "—",
                         round(wall, 1)])
    last = len(args.at)
    ok = sum(1 for r in rows if isinstance(r[last], float) and r[last] >= args.target)
    floor = sum(1 for r in rows if isinstance(r[last], float) and r[last] >= args.floor)
    append_results(f"learning over seeds (hyperrl train{' ' + ' '.join(args.extra) if args.extra else ', defaults'})",
                   f"`hyperrl train --run.seed=S {' '.join(args.extra)}`, held-out `{args.metric}` at steps "
                   f"{args.at}; {ok}/{len(rows)} seeds ≥ {args.target} and {floor}/{len(rows)} ≥ {args.floor} at step "
                   f"{args.at[-1]}:\n\n"
                   + table(["seed", *[f"step {k}" for k in args.at], f"train s to ≥ {args.target}",
                            "wall s (incl. start-up)"], rows))


if __name__ == "__main__":
    main()
