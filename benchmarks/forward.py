"""Shared-prefix vs plain policy forward+backward, side by side in one run (appended to RESULTS.md).

A Qwen3-architecture model (random init: hidden 256, 4 layers, vocab 4,096) and GRPO-shaped
batches: ``U`` prompts of ``P`` tokens, ``n`` samples each with ``S`` response tokens. Times the
forward + backward of ``(logprob + 0.01·entropy)`` summed over action tokens (median of 3), plain
(``B·(P + S − 1)`` tokens) vs shared-prefix (``U·P + B·(S − 1)`` tokens), and checks the log-probs
agree.

    python benchmarks/forward.py            # full
    python benchmarks/forward.py --quick    # one small shape, no RESULTS.md entry
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table, timeit  # noqa: E402
from hyperrl.loop.forward import plain_logprobs_and_entropy, shared_prefix_logprobs_and_entropy
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.trajectory import make_trajectory  # noqa: E402

VOCAB = 4096


def grpo_batch(U: int, n: int, P: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (U, P), generator=g).repeat_interleave(n, 0)
    resp = torch.randint(3, VOCAB, (U * n, S), generator=g)
    B, T = U * n, P + S
    act = torch.zeros(B, T, dtype=torch.bool)
    act[:, P:] = True
    return make_trajectory(tokens=torch.cat([prompts, resp], 1), attention_mask=torch.ones(B, T, dtype=torch.bool),
                           action_mask=act, rollout_logprobs=torch.where(act, -1.0, 0.0),
                           policy_version=torch.zeros(B, dtype=torch.long),
                           group_id=torch.arange(U).repeat_interleave(n), reward=torch.zeros(B))


def fwd_bwd(fn, model, batch):
    def run():
        lp, ent = fn(model, batch, 1.0)
        ((lp + 0.01 * ent) * batch["action_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    model = tiny_qwen3(VOCAB, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768)
    model.train()
    shapes = [(4, 8, 64, 16)] if args.quick else [(8, 16, 256, 16), (8, 8, 256, 64), (4, 8, 512, 128),
                                                   (4, 8, 64, 256), (16, 4, 128, 128)]
    rows = []
    for U, n, P, S in shapes:
        b = grpo_batch(U, n, P, S)
        with torch.no_grad():
            lp0 = plain_logprobs_and_entropy(model, b, 1.0)[0][b["action_mask"]]
            lp1 = shared_prefix_logprobs_and_entropy(model, b, 1.0)[0][b["action_mask"]]
        t_plain = timeit(fwd_bwd(plain_logprobs_and_entropy, model, b), repeat=3)
        t_shared = timeit(fwd_bwd(shared_prefix_logprobs_and_entropy, model, b), repeat=3)
        B = U * n
        rows.append([f"{U}×{n}", P, S, B * (P + S - 1), U * P + B * (S - 1), round(t_plain * 1e3, 1),
                     round(t_shared * 1e3, 1), round(t_plain / t_shared, 2), f"{float((lp0 - lp1).abs().max()):.1e}"])
        print(rows[-1], flush=True)
    body = table(["prompts×n", "P", "S", "plain tokens", "shared tokens", "plain ms", "shared ms", "speed-up",
                  "max |Δ logprob|"], rows)
    if args.quick:
        print(body)
    else:
        append_results("Shared-prefix forward+backward (hidden 256, 4 layers, vocab 4,096, fp32)", body)


if __name__ == "__main__":
    main()
