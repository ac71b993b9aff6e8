"""Rewards off the trainer's thread (issue 50): side by side in one run.

* ``latency`` — a reward with a sandbox-like latency (a sleep: most calls 20–100 ms, 2 % a tail of 0.5–2 s,
  fixed per row) scoring 512 samples: serially (``workers: 0``) vs 16 threads (``workers: 16``); the values equal;
* ``cpu`` — math-verify (a CPU-bound reward) on 512 GSM8K-style answers: inline vs ``workers: 2, pool: process``
  (this machine has 2 cores);
* ``async`` — the asynchronous trainer (η = 1, gated) on a generation-heavy job: s/step with a slow reward
  (the latency above, ``workers: 32``, each group scored as it finishes) vs an instant one — the reward hidden
  behind generation;
* ``sandbox`` — one sandboxed run (``Sandbox.run_python``: start + teardown) vs a bare ``subprocess.run`` of the
  same Python, and vs a run through the sandboxed fork server (``SandboxServer``).

    python benchmarks/rewards.py                          # every part
    python benchmarks/rewards.py --parts latency sandbox --no-append
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402

SLOW = textwrap.dedent('''
    import time, zlib

    def latency(key: str) -> float:
        """20-100 ms, or (2 % of keys) a 0.5-2 s tail: fixed per key."""
        h = zlib.crc32(key.encode())
        return 0.5 + (h >> 8) % 1500 / 1000 if h % 50 == 0 else 0.02 + (h >> 8) % 80 / 1000

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(latency(str(extra_info) + solution_str))
        return float(solution_str.strip() == str(ground_truth))

    def instant(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == str(ground_truth))
''')


def _fns() -> Path:
    f = Path(tempfile.mkdtemp()) / "bench_rewards.py"
    f.write_text(SLOW)
    return f


def part_latency(n: int) -> tuple[list, list[float]]:
    from hyperrl.data import Sample

    f = _fns()
    samples = [Sample(f"q{i}", str(i % 7), f"s{i}", {"extra_info": i}) for i in range(n)]
    texts = [str(i % 5) for i in range(n)]
    return _side_by_side([("serial (workers: 0)", dict(fn=f"{f}:slow", style="verl")),
                          ("16 threads (workers: 16)", dict(fn=f"{f}:slow", style="verl", workers=16))], texts, samples)


def part_cpu(n: int) -> tuple[list, list[float]]:
    from hyperrl.data import Sample

    rng = random.Random(0)
    golds = [rng.randint(1, 10_000) for _ in range(n)]
    texts = [f"Natalia sold {g // 2} clips in April and half as many in May, so altogether "
             f"$\\frac{{{2 * g}}}{{2}}$ = \\boxed{{{g if rng.random() < 0.7 else g + 1}}}." for g in golds]
    samples = [Sample(f"q{i}", str(g), f"s{i}", {}) for i, g in enumerate(golds)]
    return _side_by_side([("inline (workers: 0)", dict(fn="math_verify")),
                          ("2 processes (workers: 2, pool: process)", dict(fn="math_verify", workers=2,
                                                                          pool="process"))],
                         texts, samples, warm=8)  # warm: imports, parsers


def _side_by_side(variants: list[tuple[str, dict]], texts: list[str], samples: list, warm: int = 0
                  ) -> tuple[list, list[float]]:
    """Score the same rows with each ``(name, RewardSpec fields)``: rows of (name, samples, s, speed-up over the
    first), and the second's speed-up; the values must be equal."""
    from hyperrl.config.schema import RewardSpec
    from hyperrl.rewards import build_rewards

    n, rows, got = len(texts), [], []
    for name, spec in variants:
        rs = build_rewards([RewardSpec(**spec)])
        if warm:
            rs.score([s.prompt for s in samples[:warm]], texts[:warm], [[1]] * warm, samples[:warm])
        t0 = time.perf_counter()
        got.append(rs.score([s.prompt for s in samples], texts, [[1]] * n, samples)[0])
        rows.append([name, n, time.perf_counter() - t0])
        rs.close()
    assert all(bool((g == got[0]).all()) for g in got), "pooled scoring must equal serial scoring"
    for r in rows:
        r.append(rows[0][2] / r[2])
    return rows, [rows[0][2] / rows[1][2]]


def _async_run(reward: str, steps: int, warmup: int, prompts: int, model: list[str], eta: int) -> dict:
    """Run in a child process: s/step of the async job with ``reward``."""
    code = textwrap.dedent(f'''
        import json, statistics, tempfile, time, torch
        from hyperrl.compose import build_trainer
        from hyperrl.config import load_config
        rewards = {reward!r}
        cfg = load_config(None, ["--task=repeat", "--rollout.max_new_tokens=21", "--rollout.n=8",
                                 "--rollout.prompts_per_step={prompts}", "--async.max_staleness={eta}",
                                 "--async.schedule=gated", "--run.eval_every=0", "--run.threads=1",
                                 f"--run.out_dir={{tempfile.mkdtemp()}}", f"--rewards={{rewards}}", *{model!r}])
        torch.set_num_threads(1)
        tr = build_trainer(cfg)
        times, hidden, waited, gen = [], [], [], []
        for k in range({steps + warmup}):
            t0 = time.perf_counter()
            m = tr.step()
            if k >= {warmup}:
                times.append(time.perf_counter() - t0)
                hidden.append(m.get("reward_hidden_frac", float("nan")))
                waited.append(m.get("time_reward_s", float("nan")))
                gen.append(m.get("time_wait_s", float("nan")))
        tr.close()
        print(json.dumps({{"s_per_step": statistics.mean(times), "hidden": statistics.mean(hidden),
                          "reward_wait_s": statistics.mean(waited), "batch_wait_s": statistics.mean(gen)}}))
    ''')
    import json

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def part_async(steps: int, warmup: int, prompts: int, model: list[str], etas: list[int]) -> tuple[list, list]:
    f = _fns()
    rows, ratios = [], []
    for eta in etas:
        base = None
        for name, reward in [("instant", f"[{{fn: '{f}:instant', style: verl}}]"),
                             ("slow, 32 threads", f"[{{fn: '{f}:slow', style: verl, workers: 32}}]")]:
            got = _async_run(reward, steps, warmup, prompts, model, eta)
            base = base or got["s_per_step"]
            rows.append([eta, name, got["s_per_step"], got["batch_wait_s"], got["reward_wait_s"], got["hidden"],
                         got["s_per_step"] / base])
        ratios.append((eta, rows[-1][-1]))
    return rows, ratios


def part_sandbox(calls: int) -> tuple[list, list[float]]:
    from hyperrl.sandbox import Sandbox, allocate_uids
    from hyperrl.sandbox.server import SandboxServer

    box = Sandbox()
    server = SandboxServer(uid=allocate_uids(1)[0])
    bare = [sys.executable if not Path("/usr/bin/python3").exists() else "/usr/bin/python3", "-I", "-c", "pass"]

    def bare_run():
        subprocess.run(bare, capture_output=True, check=True)

    def boxed_run():
        assert box.run_python("pass").ok

    def served_run():
        assert server.run_python("pass").ok

    rows = []
    for name, fn in [("bare subprocess.run(python3 -c pass)", bare_run), ("Sandbox.run_python('pass')", boxed_run),
                     ("SandboxServer.run_python('pass') (fork server, cleared after)", served_run)]:
        fn()
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        rows.append([name, calls, statistics.median(ts) * 1000])
    server.close()
    for r in rows:
        r.append(r[2] / rows[0][2])
    return rows, [rows[1][2] - rows[0][2], rows[1][2] / rows[2][2]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["latency", "cpu", "async", "sandbox"])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 2], help="the async job's staleness bounds")
    ap.add_argument("--model", nargs="*", default=["--model.hidden=512", "--model.layers=4", "--model.heads=8",
                                                   "--model.kv_heads=4", "--model.head_dim=64",
                                                   "--model.intermediate=1024"],
                    help="the async job's model (config overrides): the update must take longer than the reward's "
                         "tail for it to hide")
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    out = []
    if "latency" in args.parts:
        rows, (ratio,) = part_latency(args.samples)
        out.append(f"**Sandbox-like latency** (a sleep: 20–100 ms, 2 % 0.5–2 s), {args.samples} samples: concurrent "
                   f"**{ratio:.1f}×** serial (target ≥ 8×), equal values.\n\n"
                   + table(["scoring", "samples", "s", "speed-up"], rows))
    if "cpu" in args.parts:
        rows, (ratio,) = part_cpu(args.samples)
        out.append(f"**CPU-bound reward** (math-verify, GSM8K-style answers), {args.samples} samples: 2 worker "
                   f"processes **{ratio:.2f}×** inline, equal values.\n\n"
                   + table(["scoring", "samples", "s", "speed-up"], rows))
    if "async" in args.parts:
        rows, ratios = part_async(args.steps, args.warmup, args.prompts, args.model, args.etas)
        said = ", ".join(f"**{r:.3f}×** at η = {e}" for e, r in ratios)
        out.append(f"**Async trainer** (gated; task repeat, {args.prompts}×8 samples, 21 tokens, model "
                   f"{' '.join(args.model) or 'default'}; {args.steps} steps after {args.warmup}): s/step with the "
                   f"slow reward vs an instant one {said} (target ≤ 1.15×).\n\n"
                   + table(["η", "reward", "s/step", "learner waited for the batch, s/step",
                            "learner waited on rewards, s/step", "groups scored before taken", "vs instant"], rows))
    if "sandbox" in args.parts:
        rows, (extra, served) = part_sandbox(args.calls)
        out.append(f"**Sandbox overhead** per call (median of {args.calls}): **+{extra:.1f} ms** over a bare "
                   "subprocess (prlimit → setpriv → bwrap namespaces and mounts → python3 -I; teardown); the "
                   f"sandboxed fork server runs a program **{served:.1f}×** faster than a fresh sandbox.\n\n"
                   + table(["run", "calls", "ms", "× bare"], rows))
    body = "\n\n".join(out)
    if args.no_append:
        print(body)
    else:
        append_results("Rewards off the trainer's thread (issue 50)", body)


if __name__ == "__main__":
    main()
