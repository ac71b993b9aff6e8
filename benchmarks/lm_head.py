"""An fp32 LM head (``model.lm_head_fp32``): the train–rollout log-prob mismatch of a bf16 run with and without
it, and the memory it costs at a real vocabulary.

1. **Mismatch.** The embedded default (arith) in bf16 on both sides — the trainer under bf16 autocast over fp32
   master weights (``model.dtype=bfloat16``), the transformers engine serving a bf16 copy
   (``rollout.engine: {name: transformers, dtype: bfloat16}``) — for ``--steps`` steps, with and without the
   fp32 head, the same seed. Every step reports the mismatch between the engine's log-probs and the trainer's
   recomputation of the same tokens (``mismatch_mean_abs``, ``mismatch_max_abs``, ``mismatch_k3``); the table
   gives their means over windows of steps (logits grow as the policy sharpens, and so does a bf16 head's
   rounding) and the held-out exact match at the end.
2. **Memory.** One update (prepare + update) of a random tiny Qwen3 with vocabulary 151,936 (Qwen3's) on a
   synthetic batch, bf16 autocast, with and without the fp32 head, each in a fresh process: the step's own
   peak RSS (the increase over the process after build).

    python benchmarks/lm_head.py --steps 300
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, run_child, table  # noqa: E402

_MEM = r"""
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from benchmarks._common import synthetic_update_batch
from hyperrl.compose import build_trainer
from hyperrl.config import load_config
ckpt, out, fp32, rows, R = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
tr = build_trainer(load_config(None, [f"--run.out_dir={out}", f"--model.checkpoint={ckpt}", "--model.dtype=bfloat16",
                                      f"--model.lm_head_fp32={fp32}", f"--rollout.n={rows}",
                                      "--rollout.prompts_per_step=1", "--run.eval_every=0",
                                      "--optim.micro_batch_tokens=0"]))
batch = synthetic_update_batch(rows, R)
built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
batch, _ = tr.prepare(batch)
tr.update(batch)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"built_mib": built / 1024, "own_mib": (peak - built) / 1024}))
"""


def _mismatch(steps: int, fp32: bool, out: str, seed: int) -> tuple[list[dict], dict]:
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    tr = build_trainer(load_config(None, [f"--run.out_dir={out}", "--model.dtype=bfloat16", f"--run.seed={seed}",
                                          "--rollout.engine={name: transformers, dtype: bfloat16}",
                                          f"--model.lm_head_fp32={fp32}", "--run.eval_every=0"]))
    ms = [tr.step() for _ in range(steps)]
    return ms, tr.evaluate()


def _memory(ckpt: Path, out: str, fp32: bool, rows: int, response: int) -> dict:
    return run_child(_MEM, ROOT, ckpt, out, fp32, rows, response, cwd=ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=8, help="memory: rows of the synthetic batch")
    ap.add_argument("--response", type=int, default=256, help="memory: response tokens per row")
    args = ap.parse_args()
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.tokenizer import char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        runs = {fp32: _mismatch(args.steps, fp32, f"{tmp}/m{int(fp32)}", args.seed) for fp32 in (False, True)}
        ckpt = Path(tmp) / "ckpt"
        tiny_qwen3(151_936, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                   intermediate=256).save_pretrained(ckpt)
        char_tokenizer().save_pretrained(ckpt)
        mem = {fp32: _memory(ckpt, f"{tmp}/mem{int(fp32)}", fp32, args.rows, args.response) for fp32 in (False, True)}
    q = max(1, args.steps // 3)
    windows = [(0, q), (q, 2 * q), (2 * q, args.steps)]
    rows = []
    for fp32, (ms, ev) in runs.items():
        for a, b in windows:
            w = ms[a:b]
            rows.append(["fp32 head" if fp32 else "bf16 head", f"{a + 1}–{b}",
                         sum(m["mismatch_mean_abs"] for m in w) / len(w), max(m["mismatch_max_abs"] for m in w),
                         sum(m["mismatch_k3"] for m in w) / len(w), sum(m["reward_mean"] for m in w) / len(w),
                         ev.get("eval_reward_exact_answer_mean", float("nan")) if b == args.steps else ""])
    mrows = [["fp32 head" if fp32 else "bf16 head", round(mem[fp32]["built_mib"]), round(mem[fp32]["own_mib"])]
             for fp32 in (False, True)]
    body = (f"(1) The embedded default (arith), bf16 on both sides — trainer under bf16 autocast over fp32 masters, "
            f"the transformers engine serving a bf16 copy — {args.steps} steps, seed {args.seed}, with and without "
            "`model.lm_head_fp32`; the engine's log-probs against the trainer's recomputation of the same tokens "
            "(per step, means over the window; max: the window's largest):\n\n"
            + table(["head", "steps", "mismatch mean abs", "max abs", "k3", "reward", "held-out exact at end"], rows)
            + f"\n\n(2) One update at vocabulary 151,936 (random tiny Qwen3, hidden 128, 2 layers; {args.rows} rows × "
            f"(8 + {args.response}) tokens; bf16 autocast), fresh process each: the step's own peak RSS\n\n"
            + table(["head", "after build MiB", "step's own MiB"], mrows))
    print(body)
    append_results("fp32 LM head: train–rollout mismatch in bf16 and its memory", body)


if __name__ == "__main__":
    main()
