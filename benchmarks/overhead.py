"""The loop's overhead, side by side: this checkout vs an older commit, on the default config.

Each version runs in its own process (a ``git worktree`` of ``--ref`` for the old one), alternating,
``--repeats`` times: build the trainer, ``--warmup`` steps, then ``--steps`` timed ``trainer.step()``
calls. Reports the median seconds per step of each version and their ratio; appends to RESULTS.md.
``--profile``: the timed steps run under cProfile, and the Python function calls per step are reported beside the
time (the work each version does, whatever the machine's noise).

    python benchmarks/overhead.py --ref e67ffff --steps 200
    python benchmarks/overhead.py --ref 6fa1566 57447a8 --repeats 5      # several versions, interleaved
    python benchmarks/overhead.py --ref 9e2c360 --job default            # today's default job (arith)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from hyperrl.config import load_config
try:
    from hyperrl.compose import build_trainer
except ImportError:  # commits before the composition root
    from hyperrl.train import build_trainer
warmup, steps = int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(None, ["--run.out_dir=" + sys.argv[4], "--run.eval_every=0", f"--run.steps={warmup + steps}",
                         *json.loads(sys.argv[6])])
tr = build_trainer(cfg)
for _ in range(warmup):
    tr.step()
profile = sys.argv[5] == "1"
if profile:
    import cProfile, pstats
    pr = cProfile.Profile()
    pr.enable()
t0 = time.perf_counter()
for _ in range(steps):
    tr.step()
dt = time.perf_counter() - t0
calls = 0
if profile:
    pr.disable()
    calls = pstats.Stats(pr).total_calls
print(json.dumps({"s_per_step": dt / steps, "calls_per_step": calls / steps}))
"""


# the jobs: today's default (`hyperrl train`: arith, 3-token answers) and the first default job (modsum, one token)
JOBS = {"default": [], "modsum": ["--task=modsum", "--rollout.max_new_tokens=1"]}


def _run(src: Path, warmup: int, steps: int, out: str, profile: bool, job: str = "modsum") -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(warmup), str(steps), out, str(int(profile)),
                        json.dumps(JOBS[job])],
                       capture_output=True, text=True, cwd=src, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", nargs="+", default=["e67ffff"], help="the older commit(s) to compare with (several: "
                    "every version runs once per repeat, in turn)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="time under cProfile and count function calls per step")
    ap.add_argument("--job", choices=sorted(JOBS), default="modsum", help="default: today's `hyperrl train` "
                    "(arith); modsum: the first default job (one-token answers), which old commits also run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {ref: Path(tmp) / f"ref_{ref}" for ref in args.ref}
        for ref, path in trees.items():
            subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True,
                           capture_output=True)
        trees["this checkout"] = ROOT
        try:
            runs = {k: [] for k in trees}
            for i in range(args.repeats):
                for k, src in trees.items():
                    runs[k].append(_run(src, args.warmup, args.steps, f"{tmp}/run_{len(runs[k])}_{i}_{k[:7]}",
                                        args.profile, args.job))
        finally:
            for ref in args.ref:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[ref])], cwd=ROOT, capture_output=True)
    times = {k: [r["s_per_step"] for r in v] for k, v in runs.items()}
    calls = {k: statistics.median(r["calls_per_step"] for r in v) for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    first = args.ref[0]
    heads = ["version", "median ms/step", "runs (ms/step)", f"median / {first}'s"]
    if args.profile:  # the work per step: Python function calls, independent of the machine's load
        heads += ["function calls / step", f"calls / {first}'s"]
    rows = []
    for k in trees:
        row = [k if k == "this checkout" else f"before ({k})", round(med[k] * 1e3, 2),
               " ".join(f"{t * 1e3:.2f}" for t in times[k]), round(med[k] / med[first], 3)]
        if args.profile:
            row += [round(calls[k]), round(calls[k] / calls[first], 3)]
        rows.append(row)
    job = "The default job (arith, 3-token answers" if args.job == "default" else "The modsum job (one-token answers"
    append_results("loop overhead (old commits vs this checkout)" + (", under cProfile" if args.profile else ""),
                   f"{job}; 32 prompts x 16, tiny Qwen3), {args.steps} timed steps after {args.warmup}, "
                   f"{args.repeats} rounds, each version once per round in turn, a process each:\n\n"
                   + table(heads, rows))

if __name__ == "__main__":
    main()
