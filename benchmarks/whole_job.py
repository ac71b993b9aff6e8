"""The whole default job, side by side: ``hyperrl train`` (no arguments) of this checkout vs older commits.

Each version runs the whole job — start-up, 4,000 steps, evaluations, checkpoints, the plot and the export — in
its own process and a fresh directory, as a newcomer runs it (``cd $(mktemp -d) && hyperrl train``); an older
commit from a ``git worktree``. The versions alternate ``--pairs`` times (the machine's speed drifts by tens of
percent over an hour: only runs side by side compare). Reports each run's wall time, the job's own "done: … in
N s", the phases summed over the steps (``timeline.jsonl``) and the held-out exact match at steps 1,000–4,000 (the
learning curve, which a speed-up must leave as it is); appends the table to RESULTS.md.

    python benchmarks/whole_job.py --ref e3df0e1
    python benchmarks/whole_job.py --ref e3df0e1 --pairs 1 --extra=--run.steps=200    # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402

AT = (1000, 2000, 3000, 4000)


def _job(tree: Path, extra: list[str]) -> dict:
    """One whole job of the code in ``tree``, in a fresh directory → its times and curve."""
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", *extra], cwd=d, env=env,
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode:
            raise RuntimeError(f"{tree}: hyperrl train failed:\n{r.stderr[-3000:]}")
        done = re.search(r"done: (\d+) steps in (\d+) s", r.stdout + r.stderr)
        run = Path(d) / "runs" / "default"
        phases: dict[str, float] = {}
        for line in (run / "timeline.jsonl").read_text().splitlines():
            for name, _, dur in json.loads(line).get("spans", []):
                phases[name] = phases.get(name, 0.0) + dur
        evals = {}
        for line in (run / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "eval":
                evals[rec["step"]] = rec.get("eval_reward_exact_answer_mean")
    return {"wall": wall, "done_s": int(done.group(2)) if done else None, "phases": phases,
            "curve": [evals.get(s) for s in AT]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", nargs="+", required=True, help="the older commit(s), each run beside this checkout")
    ap.add_argument("--pairs", type=int, default=2, help="rounds of every version in turn")
    ap.add_argument("--extra", action="append", default=[], help="arguments for hyperrl train (a quick check: "
                    "--extra=--run.steps=200); none: the default job, as the README runs it")
    args = ap.parse_args()
    trees, made = {"this": ROOT}, []
    try:
        for ref in args.ref:
            wt = Path(tempfile.mkdtemp(prefix=f"whole_job_{ref}_"))
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(wt), ref], check=True,
                           capture_output=True)
            made.append(wt)
            trees[ref] = wt
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        for _ in range(args.pairs):
            for name, tree in list(trees.items())[::-1]:  # the older first in each round
                runs[name].append(_job(tree, args.extra))
                r = runs[name][-1]
                print(f"{name}: wall {r['wall']:.1f} s, done in {r['done_s']} s, curve {r['curve']}", flush=True)
    finally:
        for wt in made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], capture_output=True)
    rows = []
    for name, rs in runs.items():
        for i, r in enumerate(rs):
            p = r["phases"]
            rows.append([name, i + 1, round(r["wall"], 1), r["done_s"], *(round(p.get(k, 0.0), 1) for k in
                         ("generate", "reward", "update", "publish")), " / ".join(str(c) for c in r["curve"])])
    med = {name: statistics.median(r["wall"] for r in rs) for name, rs in runs.items()}
    ratios = "; ".join(f"{name} / {ref}: {med[name] / med[ref]:.3f}" for ref in args.ref for name in ["this"])
    body = (table(["version", "round", "wall s", "done in s", "generate s", "reward s", "update s", "publish s",
                   "held-out exact @ " + " / ".join(map(str, AT))], rows)
            + "\n\nMedian wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in med.items()) + f" ({ratios}).")
    append_results("the whole default job, side by side (hyperrl train)", body)


if __name__ == "__main__":
    main()
