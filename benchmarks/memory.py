"""Peak memory of one training step against the batch size, at a real vocabulary (151,936, Qwen3's).

A random-initialised Qwen3-architecture model (``--hidden``, ``--layers``; vocabulary 151,936) is saved
as a local checkpoint; each (version, batch size) runs a step's prepare (old log-probs) and update on a
synthetic rollout batch (5-token prompts × 8 samples, 16 response tokens) in a fresh process with
``optim.micro_batch_tokens`` fixed and the gate on (``algo.gate_threshold``, a key both versions have:
the old log-probs are recomputed by a no-grad forward), and reports the process's peak RSS. ``--ref`` runs the
same steps on an older commit (a ``git worktree``) side by side. Appends to RESULTS.md.

    python benchmarks/memory.py --ref e67ffff --rows 64 128 256
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, run_child, table  # noqa: E402

_CHILD = r"""
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
import hyperrl.transforms as T
from hyperrl.config import load_config
from hyperrl.train import build_trainer
from hyperrl.trajectory import make_trajectory
ckpt, out, rows, budget = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
cfg = load_config(None, [f"--run.out_dir={out}", f"--model.checkpoint={ckpt}", "--rollout.n=8",
                         f"--rollout.prompts_per_step={rows // 8}", "--rollout.max_new_tokens=16",
                         f"--optim.micro_batch_tokens={budget}", "--algo.gate_threshold=1e9", "--run.eval_every=0"])
tr = build_trainer(cfg)
# a rollout batch of the step's shape: 8 samples of each 5-token prompt, 16 response tokens (ids in the
# tokenizer's range: the random model would sample any of the 151,936)
g = torch.Generator().manual_seed(0)
P, R = 5, 16
prompts = torch.randint(3, 92, (rows // 8, P), generator=g).repeat_interleave(8, 0)
tokens = torch.cat([prompts, torch.randint(3, 92, (rows, R), generator=g)], 1)
act = torch.arange(P + R)[None, :].expand(rows, -1) >= P
batch = make_trajectory(tokens=tokens, attention_mask=torch.ones_like(act), action_mask=act,
                        rollout_logprobs=torch.full((rows, P + R), -11.9) * act, group_id=torch.arange(rows) // 8,
                        policy_version=torch.zeros(rows, dtype=torch.long), reward=torch.rand(rows, generator=g))
batch = T.compute_advantages(batch, "grpo")
built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if hasattr(tr, "prepare"):  # this checkout
    batch, _ = tr.prepare(batch)
    tr.update(batch)
else:  # before the loop refactor
    batch, _ = tr._old_logprobs(batch)
    tr._update(batch)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"built_mib": built / 1024, "peak_mib": peak / 1024}))
"""


def _run(src: Path, ckpt: Path, out: str, rows: int, budget: int) -> dict:
    return run_child(_CHILD, src, ckpt, out, rows, budget, cwd=src)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="e67ffff", help="the older commit to compare with ('' = none)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--budget", type=int, default=512, help="optim.micro_batch_tokens")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    from hyperrl.models.tiny import tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        tiny_qwen3(151_936, hidden=args.hidden, layers=args.layers, heads=2, kv_heads=1, head_dim=32,
                   intermediate=2 * args.hidden).save_pretrained(ckpt)
        versions = [("this checkout", ROOT)]
        if args.ref:
            old = Path(tmp) / "old"
            subprocess.run(["git", "worktree", "add", "--detach", str(old), args.ref], cwd=ROOT, check=True,
                           capture_output=True)
            versions.insert(0, (f"before ({args.ref})", old))
        try:
            res = {(name, n): _run(src, ckpt, f"{tmp}/run_{i}_{n}", n, args.budget)
                   for i, (name, src) in enumerate(versions) for n in args.rows}
        finally:
            if args.ref:
                subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    rows = [[name, n, round(res[name, n]["built_mib"]), round(res[name, n]["peak_mib"]),
             round(res[name, n]["peak_mib"] - res[name, n]["built_mib"])] for name, _ in versions for n in args.rows]
    append_results("peak memory of a step vs batch size (vocab 151,936)",
                   f"Qwen3-shaped random model, hidden {args.hidden}, {args.layers} layers, vocab 151,936; one step of "
                   f"8 samples per prompt, up to 16 new tokens, `optim.micro_batch_tokens={args.budget}`, the gate on "
                   "(old log-probs recomputed), prepare + update on a 5 + 16-token batch; "
                   "peak RSS of a fresh process:\n\n"
                   + table(["version", "rows", "after build MiB", "peak MiB", "step's own MiB"], rows))


if __name__ == "__main__":
    main()
