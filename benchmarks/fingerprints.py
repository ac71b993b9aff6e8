"""What fingerprints cost a default step, and how long ``hyperrl diff`` takes over two 4,000-step runs.

1. The embedded default job (arith, 32 prompts × 16 samples, the 2-layer model), steps timed in interleaved blocks
   with the fingerprint hook (:func:`hyperrl.loop.fingerprints.write_fingerprints`) off and on; the hook's own time
   per call measured inside the same run. Target: ≤ 1 % of a default step.
2. Two run directories of 4,000 step records each, written by the hook's own :func:`step_record` from a real
   default batch and the policy's real weight digests (every record the size a default run's is): the time of
   :func:`hyperrl.diff.diff_runs` when no step differs (a full scan) and when the last step differs. Target: ≤ 10 s.

Usage: ``.venv/bin/python benchmarks/fingerprints.py [--blocks 6 --steps 15 --records 4000]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=6, help="blocks of steps per mode (interleaved off / on)")
    p.add_argument("--steps", type=int, default=15, help="steps per block")
    p.add_argument("--records", type=int, default=4000, help="step records per run for the diff")
    args = p.parse_args()

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.diff import diff_runs
    from hyperrl.loop.fingerprints import (
        package_versions,
        start_record,
        step_record,
        weight_digests,
        write_fingerprints,
    )

    tmp = Path(tempfile.mkdtemp(prefix="hyperrl-fp-"))
    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp / 'run'}", "--run.eval_every=0"]))
    (tmp / "run").mkdir(parents=True, exist_ok=True)
    hook = write_fingerprints(tmp / "run", values=10)
    spent, batch = [], {}

    def timed(event, trainer, payload):
        t = time.perf_counter()
        hook(event, trainer, payload)
        if event == "batch":
            spent.append(time.perf_counter() - t)
            batch["last"] = payload
    for _ in range(3):
        tr.step()
    per = {"off": [], "on": []}
    for _ in range(args.blocks):
        for mode in ("off", "on"):
            tr.hooks = [timed] if mode == "on" else []
            t = time.perf_counter()
            for _ in range(args.steps):
                tr.step()
            per[mode].append((time.perf_counter() - t) / args.steps)
    off, on = statistics.median(per["off"]), statistics.median(per["on"])
    hook_ms = statistics.median(spent) * 1e3
    rows = [["fingerprints off", round(off * 1e3, 2), "—"], ["fingerprints on", round(on * 1e3, 2),
                                                            f"{(on / off - 1) * 100:+.2f} %"],
            ["the hook's own time per step", round(hook_ms, 3), f"{hook_ms / (off * 1e3) * 100:.2f} % of a step"]]
    body = table(["default step", "median ms", "vs off"], rows)

    # two 4,000-step runs' records, each the size of a default run's
    names, sums = weight_digests(tr.policy)
    rec = step_record(1, batch["last"]["batch"], batch["last"]["metrics"], sums)
    tr.close()
    start = json.dumps(start_record(0, names, package_versions()))
    for name in ("a", "b"):
        d = tmp / name
        d.mkdir()
        with (d / "fingerprints.jsonl").open("w") as f:
            f.write(start + "\n")
            for k in range(1, args.records + 1):
                r = {**rec, "step": k}
                if name == "b" and k == args.records:  # the last step's loss differs in run b
                    r = {**r, "scalars": {**r["scalars"], "grad_norm": -1.0}}
                f.write(json.dumps(r) + "\n")
        if name == "a":
            size = (d / "fingerprints.jsonl").stat().st_size
    same = tmp / "a2"
    same.mkdir()
    (same / "fingerprints.jsonl").write_bytes((tmp / "a" / "fingerprints.jsonl").read_bytes())
    t = time.perf_counter()
    d_same = diff_runs(tmp / "a", same)
    t_same = time.perf_counter() - t
    t = time.perf_counter()
    d_last = diff_runs(tmp / "a", tmp / "b")
    t_last = time.perf_counter() - t
    assert d_same.step is None and d_last.step == args.records, (d_same, d_last)
    body += "\n\n" + table(["hyperrl diff of two runs", "records", "file MB", "seconds"],
                           [["no step differs (full scan)", args.records, round(size / 1e6, 1), round(t_same, 2)],
                            ["the last step differs", args.records, round(size / 1e6, 1), round(t_last, 2)]])
    body += (f"\n\nReading: fingerprints add {(on / off - 1) * 100:+.2f} % to a default step in this run (blocks of "
             f"{args.steps} steps interleaved, {args.blocks} each; the machine's noise is of that order); the hook "
             f"itself takes {hook_ms:.3f} ms a step — {hook_ms / (off * 1e3) * 100:.2f} % of the {off * 1e3:.1f} ms "
             f"step (target ≤ 1 %). A default run's records are {size / args.records / 1e3:.1f} kB a step; two "
             f"{args.records}-step runs are compared in {max(t_same, t_last):.2f} s (target ≤ 10 s).")
    append_results("fingerprints and hyperrl diff (benchmarks/fingerprints.py)", body)


if __name__ == "__main__":
    main()
