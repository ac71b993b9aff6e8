"""The whole default job, side by side: ``hyperrl train`` (no arguments) of this checkout vs older commits.

Each version runs the whole job — start-up, 4,000 steps, evaluations, checkpoints, the plot and the export — in
its own process and a fresh directory, as a newcomer runs it (``cd $(mktemp -d) && hyperrl train``); an older
commit from a ``git worktree``. The versions alternate ``--pairs`` rounds, the order turning each round (the
machine's speed drifts by tens of percent over an hour: only runs side by side compare). Reports each run's wall
time, the job's own "done: … in N s", the phases summed over the steps (``timeline.jsonl``) and the held-out exact
match at steps 1,000–4,000 (the learning curve, which a speed-up must leave as it is); appends the table to
RESULTS.md.

    python benchmarks/whole_job.py --ref e3df0e1
    python benchmarks/whole_job.py --ref e3df0e1 --pairs 1 --extra=--run.steps=200 --no-append   # a quick check
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


# `hyperrl train` of the tree on PYTHONPATH: the virtual environment's editable install of this checkout is taken
# off the import path first (it would serve a module the older tree lacks from this checkout), and every hyperrl
# module the job imported is checked to be the tree's
_LAUNCH = r"""
import atexit, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
tree = sys.argv.pop(1)

def _check():
    stray = sorted(n for n, m in list(sys.modules.items()) if n.split(".")[0] == "hyperrl"
                   and getattr(m, "__file__", None) and not m.__file__.startswith(tree.rstrip("/") + "/"))
    if stray:
        sys.stderr.write(f"modules not from {tree}: {stray}\n")
        sys.stderr.flush()
        import os
        os._exit(3)

atexit.register(_check)
sys.argv[0] = "hyperrl"
runpy.run_module("hyperrl.cli", run_name="__main__")
"""


def _job(tree: Path, extra: list[str]) -> dict:
    """One whole job of the code in ``tree``, in a fresh directory → its times and curve."""
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _LAUNCH, str(tree), "train", *extra], cwd=d, env=env,
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


def _worktree(ref: str) -> Path:
    """A detached worktree of ``ref`` in a fresh temporary directory (removed by the caller)."""
    wt = Path(tempfile.mkdtemp(prefix="whole_job_" + re.sub(r"[^A-Za-z0-9._-]", "_", ref) + "_"))
    r = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(wt), ref],
                       capture_output=True, text=True)
    if r.returncode:
        wt.rmdir()
        raise SystemExit(f"--ref {ref}: git worktree add failed: {r.stderr.strip()}")
    return wt


def main():
    """Run the versions' whole jobs in turn (see the module doc) and append their table to RESULTS.md."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", nargs="+", required=True, help="the older commit(s), each run beside this checkout")
    ap.add_argument("--pairs", type=int, default=2, help="rounds of every version in turn")
    ap.add_argument("--extra", action="append", default=[], help="arguments for hyperrl train (a quick check: "
                    "--extra=--run.steps=200); none: the default job, as the README runs it")
    ap.add_argument("--no-append", action="store_true", help="print the table only (a quick check)")
    args = ap.parse_args()
    trees, made = {"this": ROOT}, []
    try:
        for ref in args.ref:
            trees[ref] = _worktree(ref)
            made.append(trees[ref])
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        for k in range(args.pairs):  # ABBA: the order turns each round, so a drift of the machine's speed
            order = list(trees.items())  # within a pair of rounds weighs on every version alike
            for name, tree in (order[::-1] if k % 2 == 0 else order):
                r = _job(tree, args.extra)
                runs[name].append(r)
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
    ratios = "; ".join(f"this / {ref}: {med['this'] / med[ref]:.3f}" for ref in args.ref)
    body = (table(["version", "round", "wall s", "done in s", "generate s", "reward s", "update s", "publish s",
                   "held-out exact @ " + " / ".join(map(str, AT))], rows)
            + "\n\nMedian wall: " + ", ".join(f"{k} {v:.1f} s" for k, v in med.items()) + f" ({ratios}).")
    if args.no_append:
        print(body)
    else:
        append_results("the whole default job, side by side (hyperrl train)", body)


if __name__ == "__main__":
    main()
