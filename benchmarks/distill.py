"""On-policy distillation against RL from scratch on the arith default: steps to held-out exact ≥ ``--target``.

The teacher is a run of ``hyperrl train`` (the embedded default, ``--teacher-seed``) — its ``hf/`` export, or
``--teacher DIR`` to reuse one. For each seed a fresh random student (the same architecture) trains with
``algo.distill: {teacher: hf/, task_coef: 1, whiten: true}`` (the whitened sampled reverse-KL advantage plus the
task's GRPO advantage; ``--task-coef 0`` for distillation alone) and, side by side, RL from scratch (the default,
nothing changed); both evaluate on the held-out problems every ``--eval-every`` steps and stop at the first
evaluation ≥ ``--target`` (or ``--max-steps``). The table gives, per seed, the step and training seconds at which
each first reached it and the step ratio; the curves (held-out exact at each evaluation) follow. Appends to
RESULTS.md.

    python benchmarks/distill.py --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402

METRIC = "eval_reward_exact_answer_mean"


def _teacher(out: Path, seed: int) -> Path:
    r = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", f"--run.out_dir={out}", f"--run.seed={seed}"],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return out / "hf"


def _until(overrides: list[str], target: float, every: int, max_steps: int) -> dict:
    """Train in this process, evaluating every ``every`` steps, until held-out ≥ target (or max_steps)."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    tr = build_trainer(load_config(None, ["--run.eval_every=0", *overrides]))
    curve, train_s, reached = [], 0.0, None
    while tr.step_idx < max_steps:
        t0 = time.perf_counter()
        for _ in range(every):
            tr.step()
        train_s += time.perf_counter() - t0
        v = tr.evaluate()[METRIC]
        curve.append((tr.step_idx, round(v, 3)))
        if v >= target:
            reached = (tr.step_idx, train_s)
            break
    tr.close()
    return {"curve": curve, "reached": reached}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--teacher", default="", help="a teacher's HF directory (default: train one now)")
    ap.add_argument("--teacher-seed", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--task-coef", type=float, default=1.0, help="algo.distill.task_coef (0 = distillation alone)")
    ap.add_argument("--whiten", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--full-vocab", action="store_true", help="algo.distill.full_vocab: the reverse KL over the "
                    "whole next-token distribution as a loss term (on-policy GKD) instead of the sampled advantage")
    ap.add_argument("--jsd-beta", type=float, default=1.0, help="with --full-vocab: algo.distill.jsd_beta (1 the "
                    "reverse KL, 0 the forward KL(teacher ‖ student), between: GKD's generalized JSD)")
    ap.add_argument("--student", action="extend", nargs="*", default=[], help="more overrides for the students only "
                    "(repeatable), e.g. --student=--algo.entropy_coef=0 --student=--rollout.n=4")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        teacher = Path(args.teacher) if args.teacher else _teacher(Path(tmp) / "teacher", args.teacher_seed)
        teacher_s = time.perf_counter() - t0
        from hyperrl.compose import build_trainer
        from hyperrl.config import load_config

        teacher_eval = build_trainer(load_config(None, [f"--run.out_dir={tmp}/t_eval", f"--model.checkpoint={teacher}",
                                                        "--run.eval_every=0"])).evaluate()[METRIC]
        res = {}
        for s in args.seeds:
            opd = [f"--run.out_dir={tmp}/opd{s}", f"--run.seed={s}", f"--algo.distill.teacher={teacher}",
                   f"--algo.distill.coef={args.coef}", f"--algo.distill.task_coef={args.task_coef}",
                   f"--algo.distill.whiten={args.whiten}", f"--algo.distill.full_vocab={args.full_vocab}",
                   *([f"--algo.distill.jsd_beta={args.jsd_beta}"] if args.full_vocab else []), *args.student]
            res[s] = {"opd": _until(opd, args.target, args.eval_every, args.max_steps),
                      "rl": _until([f"--run.out_dir={tmp}/rl{s}", f"--run.seed={s}"], args.target, args.eval_every,
                                   args.max_steps)}
            print(s, json.dumps({k: v["reached"] for k, v in res[s].items()}), flush=True)
    rows, ratios = [], []
    for s, r in res.items():
        o, q = r["opd"]["reached"], r["rl"]["reached"]
        ratio = f"{o[0] / q[0]:.2f}" if o and q else "—"
        if o and q:
            ratios.append(o[0] / q[0])
        rows.append([s, o[0] if o else f"> {args.max_steps}", f"{o[1]:.0f}" if o else "—",
                     q[0] if q else f"> {args.max_steps}", f"{q[1]:.0f}" if q else "—", ratio])
    curves = "\n".join(f"- seed {s}: OPD {r['opd']['curve']}; RL {r['rl']['curve']}" for s, r in res.items())
    src = f"`--teacher {args.teacher}`" if args.teacher else f"trained now by `hyperrl train --run.seed=" \
        f"{args.teacher_seed}` ({teacher_s:.0f} s)"
    body = (f"Teacher: {src}, held-out exact {teacher_eval:.3f}. Students: fresh random tiny Qwen3s (the default "
            f"architecture), `--algo.distill.teacher=<its hf/> --algo.distill.coef={args.coef} "
            f"--algo.distill.task_coef={args.task_coef} --algo.distill.whiten={args.whiten} "
            f"--algo.distill.full_vocab={args.full_vocab}"
            f"{f' --algo.distill.jsd_beta={args.jsd_beta}' if args.full_vocab else ''}"
            f"{''.join(' ' + x for x in args.student)}` against RL from "
            "scratch (the default), the same seeds; "
            f"held-out exact every {args.eval_every} steps, stopping at ≥ {args.target}:\n\n"
            + table(["seed", "OPD step", "OPD train s", "RL step", "RL train s", "step ratio OPD/RL"], rows)
            + (f"\n\nMean step ratio {sum(ratios) / len(ratios):.2f} over {len(ratios)} seeds." if ratios else "")
            + "\n\nCurves (step, held-out exact):\n\n" + curves)
    print(body)
    append_results("on-policy distillation vs RL from scratch (arith)", body)


if __name__ == "__main__":
    main()
