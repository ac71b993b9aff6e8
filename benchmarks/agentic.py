"""Where asynchronous RL pays: multi-turn episodes whose tool waits like a real sandbox.

The calculator task (configs/calculator.yaml: ``products`` in the ``calculator_copy`` environment) with a
tool whose latency is long-tailed — most calls 20–100 ms, one in ten 0.5–2 s — a *sleep*, not CPU work,
drawn per (question, call) from a fixed seed so every mode meets the same latencies. Each mode trains in
its own process until the held-out success rate reaches ``--target`` (or ``--steps``), evaluating every
``--every`` steps off the clock:

* ``sync``: SyncTrainer, every turn's tool calls concurrent (``rollout.max_concurrent_episodes``), so a
  turn waits for its slowest call; generation and update on all ``--cores`` torch threads;
* ``η`` (``1``, ``2``): AsyncTrainer at ``async.max_staleness = η`` — a finished turn goes to its
  episode's tool on a thread pool while the worker generates other episodes' turns and the learner
  trains; worker and learner ``--cores / 2`` threads each;
* ``ηr``: the same with the rollout worker a Ray actor pinned to its own cores (benchmarks/async.py's
  setup).

    python benchmarks/agentic.py                          # sync, 1, 2, 1r to held-out success 0.5
    python benchmarks/agentic.py --modes sync 1 --target 0.9 --steps 500
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, pin_actor, start_pinned_ray, table  # noqa: E402

CONFIG = "configs/calculator.yaml"
METRIC = "eval_success_rate"


def latency_s(question: str, call: int, *, tail: float = 0.1) -> float:
    """A sandbox's latency for call ``call`` on ``question``: 20–100 ms, or 0.5–2 s with probability ``tail``
    — a pure function of its arguments (every mode waits the same)."""
    rng = random.Random(int.from_bytes(hashlib.blake2b(f"{question}|{call}".encode(), digest_size=8).digest(), "big"))
    return rng.uniform(0.5, 2.0) if rng.random() < tail else rng.uniform(0.02, 0.1)


def register_sandbox() -> None:
    """``env: {name: calculator_sandbox}``: ``calculator_copy`` whose calls sleep :func:`latency_s`."""
    from hyperrl.envs import ENVIRONMENTS, CalculatorCopyEnv

    if "calculator_sandbox" in ENVIRONMENTS.names():
        return

    @ENVIRONMENTS.register("calculator_sandbox")
    class SandboxCalculator(CalculatorCopyEnv):
        def _call(self, action):
            out = super()._call(action)
            if out is not None:
                time.sleep(latency_s(str(self.sample.prompt), self.calls))
            return out


def run_mode(mode: str, steps: int, every: int, cores: int, seed: int, target: float, eval_prompts: int) -> dict:
    """One mode in this process: train until the held-out success reaches ``target`` (or ``steps``)."""
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    register_sandbox()
    ray_ = mode.endswith("r")
    eta = None if mode == "sync" else int(mode.rstrip("r"))
    threads = cores if eta is None else max(1, cores // 2)
    ov = ["--env={name: calculator_sandbox, format: compact, call_reward: 0.1, max_calls: 1}",
          "--rollout.max_concurrent_episodes=512", f"--run.out_dir={tempfile.mkdtemp()}", f"--run.seed={seed}",
          f"--run.threads={threads}", "--run.eval_every=0", f"--run.eval_prompts={eval_prompts}"]
    if eta is not None:
        ov.append(f"--async.max_staleness={eta}")
    if ray_:
        rollout = start_pinned_ray(threads)
        ov.append(f"--async.executor={{name: ray, workers: 1, num_cpus: 1, threads: {threads}}}")
    torch.set_num_threads(threads)
    cfg = load_config(CONFIG, ov)
    r = cfg.rollout
    tr = build_trainer(cfg)
    if ray_:
        pin_actor(tr, rollout)
    clock, evals, phases, tokens, calls, s = 0.0, [], {}, 0, 0.0, 0
    try:
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            m = tr.step()
            clock += time.perf_counter() - t0
            tokens += int(m.get("response_len_mean", 0) * r.prompts_per_step * r.n)
            calls += m.get("tool_call_rate", 0.0)
            for k, v in m.items():
                if k.startswith("time_") and k.endswith("_s"):
                    phases[k] = phases.get(k, 0.0) + v
            if s % every == 0:
                e = tr.evaluate()
                evals.append((s, round(clock, 2), round(e[METRIC], 4)))
                if e[METRIC] >= target:
                    break
    finally:
        getattr(tr, "close", lambda: None)()
    return {"mode": mode, "threads": threads, "clock_s": clock, "steps": s, "evals": evals,
            "phases": {k: v / s for k, v in phases.items()}, "staleness_max": m.get("staleness_max", 0.0),
            "tokens_per_s": tokens / clock, "call_rate": calls / s}


def _name(mode: str) -> str:
    return "sync" if mode == "sync" else f"async η={mode.rstrip('r')}" + (" (Ray actor)" if mode.endswith("r") else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["sync", "1", "2", "1r"])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--target", type=float, default=0.5, help="held-out success rate to time")
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one:
        print("RESULT " + json.dumps(run_mode(args._one, args.steps, args.every, args.cores, args.seed, args.target,
                                              args.eval_prompts)))
        return
    res = []
    for mode in args.modes:  # one process per mode, one at a time (each uses the machine's cores)
        out = subprocess.run([sys.executable, __file__, f"--_one={mode}", f"--steps={args.steps}",
                              f"--every={args.every}", f"--cores={args.cores}", f"--seed={args.seed}",
                              f"--target={args.target}", f"--eval-prompts={args.eval_prompts}"],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"mode {mode} failed:\n{out.stderr[-3000:]}")
        res.append(json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:]))
        print(mode, round(res[-1]["clock_s"], 1), res[-1]["steps"], res[-1]["evals"], flush=True)
    Path("/tmp/hyperrl_agentic_bench.json").write_text(json.dumps(res))

    def reach(r):
        return next((t for _, t, v in r["evals"] if v >= args.target), None)

    sync = next((x for x in res if x["mode"] == "sync"), None)
    thread1 = next((x for x in res if x["mode"] == "1"), None)
    rows = []
    for r in res:
        t, ph = reach(r), r["phases"]
        ratio = "" if sync is None or t is None or reach(sync) is None else f"{reach(sync) / t:.2f}×"
        rows.append([_name(r["mode"]), r["threads"], r["steps"], round(r["clock_s"] / r["steps"], 3),
                     t if t is not None else "—", ratio, r["evals"][-1][2], round(r["call_rate"], 3),
                     round(ph.get("time_generate_s", 0.0), 3), round(ph.get("time_wait_s", 0.0), 3),
                     round(ph.get("time_update_s", 0.0), 3), r["staleness_max"], round(r["tokens_per_s"])])
    lines = []
    if thread1 is not None:
        for r in res:
            if r["mode"].endswith("r") and reach(r) and reach(thread1):
                lines.append(f"- {_name(r['mode'])}: {reach(r) / reach(thread1):.2f}× the thread executor's time to "
                             f"≥ {args.target} ({r['tokens_per_s'] / thread1['tokens_per_s']:.2f}× its tokens/s)")
    cmd = " ".join(["python benchmarks/agentic.py", *sys.argv[1:]])
    append_results("where async pays: multi-turn episodes with a long-tailed tool (benchmarks/agentic.py)",
                   f"`{cmd}`: {CONFIG} (products, calculator_copy, 32 prompts × 16, 2 turns when the policy calls) "
                   "with the call sleeping 20–100 ms, one call in ten 0.5–2 s (a sandbox's tail; `latency_s`, the "
                   "same per question in every mode); every mode trains until held-out `eval_success_rate` ≥ "
                   f"{args.target} ({args.eval_prompts} held-out problems every {args.every} steps, off the clock) "
                   f"or {args.steps} steps; seed {args.seed}. Sync: {args.cores} torch threads, a turn's tool calls "
                   f"concurrent; async: worker and learner {max(1, args.cores // 2)} thread each, tools on the "
                   f"collector's pool. `s to target` = wall seconds of training:\n\n"
                   + table(["mode", "threads", "steps", "s/step", f"s to ≥ {args.target}", "sync / this",
                            "final held-out", "tool-call rate (train)", "generate s", "learner wait s", "update s",
                            "max staleness", "tokens/s"], rows) + ("\n\n" + "\n".join(lines) if lines else ""))


if __name__ == "__main__":
    main()
