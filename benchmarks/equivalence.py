"""Behaviour unchanged: the same jobs run at a fixed step count on two source trees give the same metrics.

A restructuring commit must not change what a run computes. This script runs each job below with the
library taken from each tree given (``PYTHONPATH=<tree>``, the current ``.venv``'s packages), for a fixed
number of steps from a fresh ``out_dir``, and digests every metric of ``metrics.jsonl`` except wall-clock
ones (``time_*``, ``*_per_s``, ``*seconds*``) — xxh3-64 of the values written as ``repr`` floats, so one
rounding difference anywhere changes it. Old and new side by side in one run::

    git worktree add /tmp/base <old-commit>
    .venv/bin/python benchmarks/equivalence.py --trees /tmp/base . [--jobs default moe ...]

Prints a table (job, one digest per tree, equal?) and appends it to RESULTS.md; exits 1 if any differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import xxhash

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ROOT / "tests" / "data" / "pairs_tiny.parquet"
GSM = ROOT / "tests" / "data" / "gsm8k_tiny.parquet"

# name → (overrides); {teacher} is a tiny Qwen3 directory made once per run (the default's architecture)
JOBS: dict[str, list[str]] = {
    "default": ["--run.steps=12", "--run.eval_every=6"],
    "kl_reference": ["--run.steps=6", "--algo.kl.coef=0.05", "--algo.gate_threshold=1e-3"],
    "ppo_critic": ["--config=configs/ppo_critic.yaml", "--run.steps=8"],
    "remax": ["--algo.recipe=remax", "--run.steps=6"],
    "m2po": ["--algo.recipe=m2po", "--run.steps=6"],
    "optimal_token_baseline": ["--algo.advantage=optimal_token_baseline", "--run.steps=6"],
    "a3po_async": ["--algo.proximal=interpolate", "--async.max_staleness=1", "--run.steps=8"],
    "distill": ["--algo.distill.teacher={teacher}", "--run.steps=6"],
    "distill_full_vocab": ["--algo.distill={{teacher: {teacher}, full_vocab: true}}", "--run.steps=6"],
    "moe": ["--config=configs/moe.yaml", "--run.steps=8"],
    "moe_r2_kl": ["--config=configs/moe.yaml", "--algo.routing_replay=r2", "--algo.kl.coef=0.05", "--run.steps=6"],
    "moe_r3_kl": ["--config=configs/moe.yaml", "--algo.routing_replay=r3", "--algo.kl.coef=0.05", "--run.steps=6"],
    "vision": ["--config=configs/vision.yaml", "--run.steps=4", "--run.eval_prompts=32"],
    "calculator": ["--config=configs/calculator.yaml", "--run.steps=4"],
    "calculator_gated": ["--config=configs/calculator.yaml", "--async.max_staleness=1", "--async.schedule=gated",
                         "--run.steps=4"],
    # the agents' engine calls batch their requests as they arrive (agent_engine_calls varies run to run), so the
    # rollout's log-probs differ by float rounding: compared at 5 significant digits without the mismatch metrics
    "agent": ["--config=configs/calculator_agent.yaml", "--run.steps=3", "--rollout.prompts_per_step=8"],
    "preference": ["--algo.recipe=dpo", f"--data.train_files=[{PAIRS}]", f"--data.val_files=[{PAIRS}]",
                   "--run.steps=6", "--run.eval_every=3"],
    "async": ["--async.max_staleness=1", "--run.steps=10"],
    "async_ray": ["--async.max_staleness=1", "--async.executor=ray", "--run.steps=6"],
}


def _teacher(path: Path) -> str:
    """The default config's tiny Qwen3 (another seed) and the character tokenizer, saved as a directory."""
    code = ("import sys; from hyperrl.models import tiny_qwen3; from hyperrl.tokenizer import char_tokenizer\n"
            "tok = char_tokenizer(); m = tiny_qwen3(len(tok), seed=7, pad_id=tok.pad_token_id, "
            "bos_id=tok.bos_token_id, eos_id=tok.eos_token_id, hidden=128, layers=2, heads=4, kv_heads=2, "
            "head_dim=32, intermediate=256)\nm.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, cwd=ROOT)
    return str(path)


NOISY = {"agent"}  # jobs compared up to float rounding (see JOBS)
BATCHING = ("agent_engine_calls", "mismatch_", "approx_kl")


def digest(metrics: Path, noisy: bool = False) -> tuple[str, int]:
    """xxh3-64 of every non-wall-clock metric and the number of lines; ``noisy``: without the metrics the engine's
    request batching moves (:data:`BATCHING`), every float at 5 significant digits."""
    h, n = xxhash.xxh3_64(), 0
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        keep = {k: v for k, v in rec.items() if not (k.startswith("time_") or k.endswith("_per_s")
                                                     or "seconds" in k or k.endswith("_s"))}
        if noisy:
            keep = {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in keep.items()
                    if not k.startswith(BATCHING)}
        h.update(repr(sorted(keep.items())).encode())
        n += 1
    return h.hexdigest(), n


def run(tree: Path, job: str, overrides: list[str], work: Path) -> tuple[str, int]:
    out = work / f"{tree.name or 'tree'}-{abs(hash(str(tree)))}" / job
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "hyperrl.cli", "train", "--no-resume", f"--run.out_dir={out}", "--run.seed=0",
           *overrides]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode:
        return f"failed: {r.stderr.strip().splitlines()[-1][:80] if r.stderr.strip() else r.returncode}", 0
    return digest(out / "metrics.jsonl", noisy=job in NOISY)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", type=Path, default=[ROOT])
    ap.add_argument("--jobs", nargs="*", default=list(JOBS))
    ap.add_argument("--no-append", action="store_true")
    args = ap.parse_args()
    unknown = sorted(set(args.jobs) - set(JOBS))
    if unknown:
        ap.error(f"unknown jobs {unknown}; known: {list(JOBS)}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import append_results, table

    work = Path(tempfile.mkdtemp(prefix="hyperrl-eq-"))
    teacher = _teacher(work / "teacher")
    rows, bad = [], 0
    for job in args.jobs:
        over = [o.format(teacher=teacher) for o in JOBS[job]]
        got = [run(t.resolve(), job, over, work) for t in args.trees]
        same = len({g for g in got}) == 1 and got[0][1] > 0
        bad += not same
        rows.append([job, *[f"{d} ({n} lines)" for d, n in got], "yes" if same else "NO"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    heads = ["job", *[str(t) for t in args.trees], "equal"]
    body = table(heads, rows)
    if args.no_append:
        print(body)
    else:
        append_results("equivalence: metrics digests of fixed-step runs, trees side by side", body)
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
