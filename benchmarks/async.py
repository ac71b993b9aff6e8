"""Synchronous vs asynchronous RL on this machine: wall time to a held-out reward, s/step, tokens/s.

Each mode trains the same config in its own process; evaluation time is excluded from the clock.

* ``sync``: SyncTrainer, every phase on all ``--cores`` torch threads (generation, then update);
* ``async η``: AsyncTrainer with ``async.max_staleness = η``: the rollout worker thread and the
  learner each use ``--cores / 2`` threads (disjoint cores), generation overlapping the update;
* ``async η, decoupled`` (mode ``ηd``): the same with the decoupled-PPO behaviour correction
  (``algo.correction: tis``: the learner recomputes the proximal policy, tokens weighted by
  ``π_prox / π_behav``);
* ``async η, Ray`` (mode ``ηr``, ``ηdr``): the rollout worker is a Ray actor — its own process,
  pinned to the second half of the cores while the learner is pinned to the first half (no GIL
  shared with the learner).

    python benchmarks/async.py                       # the long-tail repeat task, 21-token budget
    python benchmarks/async.py --modes sync 1 4 4d --steps 400 --target 0.6
    python benchmarks/async.py --modes sync 1 1r --prompts 16 --seeds 0 1 2 --steps 400   # generation-heavier
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

from benchmarks._common import append_results, pin_actor, start_pinned_ray, table  # noqa: E402

# the long-tail task: 80 % of answers 1–3 digits, 20 % 12–20 (hyperrl.tasks.RepeatTask)
BASE = ["--task=repeat", "--rollout.max_new_tokens=21", "--rollout.n=8", "--run.eval_every=0", "--run.eval_prompts=256"]
N = 8  # samples per prompt
METRIC = "eval_reward_digit_credit_mean"


def run_mode(mode: str, steps: int, every: int, cores: int, seed: int, prompts: int) -> dict:
    """One mode in this process: train ``steps`` steps, evaluate every ``every`` (off the clock)."""
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    ray_ = mode.endswith("r")
    core = mode.rstrip("r")
    eta, decoupled = (None, False) if core == "sync" else (int(core.rstrip("d")), core.endswith("d"))
    threads = cores if eta is None else max(1, cores // 2)
    ov = BASE + [f"--run.out_dir={tempfile.mkdtemp()}", f"--run.seed={seed}", f"--run.threads={threads}",
                 f"--rollout.prompts_per_step={prompts}"]
    if eta is not None:
        ov.append(f"--async.max_staleness={eta}")
    if decoupled:
        ov.append("--algo.correction=tis")
    if ray_:
        rollout = start_pinned_ray(threads)
        ov.append(f"--async.executor={{name: ray, workers: 1, num_cpus: 1, threads: {threads}}}")
    torch.set_num_threads(threads)
    tr = build_trainer(load_config(None, ov))
    if ray_:
        pin_actor(tr, rollout)
    clock, evals, phases, tokens = 0.0, [], {}, 0
    try:
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            m = tr.step()
            clock += time.perf_counter() - t0
            tokens += int(m.get("response_len_mean", 0) * prompts * N)
            for k, v in m.items():
                if k.startswith("time_") and k.endswith("_s"):
                    phases[k] = phases.get(k, 0.0) + v
            if s % every == 0:
                e = tr.evaluate()
                evals.append((s, round(clock, 2), round(e[METRIC], 4)))
        stale = m.get("staleness_max", 0.0)
    finally:
        getattr(tr, "close", lambda: None)()
    return {"mode": mode, "threads": threads, "clock_s": clock, "evals": evals,
            "phases": {k: v / steps for k, v in phases.items()}, "staleness_max": stale,
            "evicted": m.get("async_evicted", 0), "tokens_per_s": tokens / clock}


def _name(mode: str) -> str:
    core = mode.rstrip("r")
    return "sync" if core == "sync" else f"async η={core.rstrip('d')}" + \
        (" decoupled" if core.endswith("d") else "") + (" (Ray actor)" if mode.endswith("r") else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["sync", "1", "2", "4", "4d"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--target", type=float, default=0.5, help="held-out digit credit to time")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (× 8 samples)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one:
        print("RESULT " + json.dumps(run_mode(args._one, args.steps, args.every, args.cores, args.seeds[0],
                                              args.prompts)))
        return
    res = []
    for seed in args.seeds:
        for mode in args.modes:  # one process per mode, one at a time (each uses the machine's cores)
            out = subprocess.run([sys.executable, __file__, f"--_one={mode}", f"--steps={args.steps}",
                                  f"--every={args.every}", f"--cores={args.cores}", f"--seeds={seed}",
                                  f"--prompts={args.prompts}"], capture_output=True, text=True, check=True)
            res.append({**json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:]),
                        "seed": seed})
            print(seed, res[-1]["mode"], res[-1]["clock_s"], res[-1]["evals"][-1], flush=True)
    Path("/tmp/hyperrl_async_bench.json").write_text(json.dumps(res))  # the raw evals, for a second look

    def reach(r, target):
        return next((t for _, t, v in r["evals"] if v >= target), None)

    rows, summary = [], {}
    for r in res:
        sync = next((x for x in res if x["mode"] == "sync" and x["seed"] == r["seed"]), None)
        t, ph = reach(r, args.target), r["phases"]
        ratio = "" if sync is None or t is None or reach(sync, args.target) is None else \
            f"{reach(sync, args.target) / t:.2f}×"
        final = sync["evals"][-1][2] if sync else None  # the yardstick: sync's final held-out reward
        tf = reach(r, final) if final is not None else None
        ratio_f = "" if tf is None else f"{sync['clock_s'] / tf:.2f}×"
        per_step = sync["clock_s"] / r["clock_s"] if sync else None
        summary.setdefault(r["mode"], []).append((per_step, sync["clock_s"] / tf if tf else None))
        rows.append([r["seed"], _name(r["mode"]), r["threads"], round(r["clock_s"] / args.steps, 3),
                     f"{per_step:.2f}×" if per_step else "", t if t is not None else "—", ratio,
                     tf if tf is not None else "—", ratio_f, r["evals"][-1][2],
                     round(ph.get("time_generate_s", 0.0), 3), round(ph.get("time_wait_s", 0.0), 3),
                     round(ph.get("time_update_s", 0.0), 3), r["staleness_max"], r["evicted"],
                     round(r["tokens_per_s"])])
    lines = []
    for mode, vals in summary.items():
        steps_r = sorted(v for v, _ in vals if v)
        fin = [f for _, f in vals]
        if mode != "sync" and steps_r:
            got = sorted(f for f in fin if f)
            lines.append(f"- {_name(mode)}: per step {steps_r[len(steps_r) // 2]:.2f}× sync (median of "
                         f"{len(steps_r)}); reached sync's final in {len(got)}/{len(fin)} seeds"
                         + (f", sync total / that: median {got[len(got) // 2]:.2f}× (all: "
                            f"{', '.join(f'{f:.2f}×' for f in got)})" if got else ""))
    cmd = " ".join(["python benchmarks/async.py", *sys.argv[1:]])
    append_results("async vs sync (rollout worker: a thread, or a Ray actor pinned to its own cores)",
                   f"`{cmd}`: task repeat (answers of 1–3 digits, 20 % of 12–20; 21-token budget), "
                   f"{args.prompts} prompts × {N}, {args.steps} steps, seeds {args.seeds}; held-out `{METRIC}` "
                   f"every {args.every} steps (evaluation off the clock). Sync: {args.cores} torch threads per "
                   f"phase; async: worker and learner {max(1, args.cores // 2)} each (Ray: the actor, Ray's own "
                   f"processes and the learner pinned to disjoint cores). `s to ≥ {args.target}` = wall seconds "
                   f"of training; `to sync's final` = wall seconds until the held-out reward first reaches the same "
                   f"seed's sync final, and sync's whole training time over it:\n\n"
                   + table(["seed", "mode", "threads", "s/step", "sync s/step / this", f"s to ≥ {args.target}",
                            "vs sync", "to sync's final", "sync total / that", "final held-out",
                            "generate s", "learner wait s", "update s", "max staleness", "evicted", "tokens/s"],
                           rows) + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
