"""Transforms benchmark, side by side in one run (results appended to benchmarks/RESULTS.md).

1. GRPO group advantages at B = 4,096 / 65,536 / 1,048,576 (groups of 8 and 16): hyperrl's
   segment-sum kernel vs a per-sample Python loop of the same math, and verl 0.9.1's ``grpo`` /
   ``grpo_vectorized`` when verl imports (``pip install -e '.[bench]'`` or ``--no-deps verl``).
2. PPO-clip policy loss forward+backward at [512, 4096]: eager vs ``torch.compile``.
3. Token log-probs + entropy at [8, 1024] × 151,936 (bf16 logits): chunked fp32 vs naive fp32
   ``log_softmax`` — time and peak extra RSS, each in a fresh subprocess.

    python benchmarks/transforms.py            # full
    python benchmarks/transforms.py --quick    # small sizes, no RESULTS.md entry
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import uuid

import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table, timeit  # noqa: E402
from hyperrl import transforms as T  # noqa: E402


def loop_grpo(scores, gids, eps=1e-6):
    groups = {}
    for s, g in zip(scores, gids):
        groups.setdefault(g, []).append(s)
    stats = {}
    for g, xs in groups.items():
        mu = sum(xs) / len(xs)
        sd = (sum((x - mu) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5
        stats[g] = (mu, sd, len(xs) < 2 or max(xs) == min(xs))
    out = []
    for s, g in zip(scores, gids):
        mu, sd, degenerate = stats[g]
        out.append(0.0 if degenerate else (s - mu) / (sd + eps))
    return out


def _verl():
    try:
        from verl.trainer.ppo import core_algos

        return core_algos
    except Exception as e:  # noqa: BLE001 - report why the peer is absent
        print(f"[verl unavailable: {type(e).__name__}: {e}]")
        return None


def bench_advantages(sizes, group_sizes):
    verl = _verl()
    rows = []
    for B in sizes:
        for n in group_sizes:
            g = torch.Generator().manual_seed(0)
            s = torch.bernoulli(torch.full((B,), 0.4), generator=g) + 0.1 * torch.rand(B, generator=g)
            gid = torch.arange(B) // n
            ours = T.grpo_advantages(s, gid)
            t_ours = timeit(lambda: T.grpo_advantages(s, gid), repeat=9, warmup=3)
            row = [B, n, t_ours * 1e3]
            if B <= 1_048_576:
                t0 = time.perf_counter()
                ref = torch.tensor(loop_grpo(s.tolist(), gid.tolist()))
                t_loop = time.perf_counter() - t0
                row += [t_loop * 1e3, t_loop / t_ours, float((ours - ref).abs().max())]
            if verl is not None:
                mask = torch.ones(B, 1)
                # verl labels groups with uuid4 strings (ray_trainer: str(uuid.uuid4()) per prompt)
                names = [str(uuid.UUID(int=random.getrandbits(128))) for _ in range(B // n)]
                uids = np.array([names[i] for i in gid.tolist()], dtype=object)
                rewards = s[:, None]
                kw = dict(token_level_rewards=rewards, response_mask=mask, index=uids, epsilon=1e-6)
                fv = getattr(verl, "compute_grpo_vectorized_outcome_advantage", None)
                t_vec = timeit(lambda: fv(**kw), repeat=3) if fv else float("nan")
                v_vec = fv(**kw)[0][:, 0] if fv else None
                t_vloop = timeit(lambda: verl.compute_grpo_outcome_advantage(**kw), repeat=1, warmup=0) \
                    if B <= 65_536 else float("nan")
                v_loop = verl.compute_grpo_outcome_advantage(**kw)[0][:, 0] if B <= 65_536 else None
                diff = max(float((ours - v).abs().max()) for v in (v_vec, v_loop) if v is not None)
                row += [t_vloop * 1e3, t_vec * 1e3, t_vec / t_ours, diff]
            rows.append(row)
    headers = ["B", "group", "hyperrl ms", "py-loop ms", "loop/hyperrl", "max|diff| loop"]
    if verl is not None:
        headers += ["verl grpo ms", "verl grpo_vectorized ms", "verl_vec/hyperrl", "max|diff| verl"]
    return table(headers, rows)


def bench_policy_loss(B, Tn):
    g = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(B, Tn, generator=g)
    old = lp0 + 0.05 * torch.randn(B, Tn, generator=g)
    adv = torch.randn(B, Tn, generator=g)
    mask = torch.rand(B, Tn, generator=g) > 0.1

    def loss_fn(x):
        return T.aggregate(T.ppo_clip(x, old, adv, mask, clip_high=0.28).loss, mask, "token-mean")

    compiled = torch.compile(loss_fn, fullgraph=True)

    def step(fn):
        x = lp0.clone().requires_grad_(True)
        fn(x).backward()

    t_eager = timeit(lambda: step(loss_fn))
    t_comp = timeit(lambda: step(compiled), warmup=2)
    return table(["shape", "eager ms", "compiled ms", "eager/compiled"],
                 [[f"[{B}, {Tn}]", t_eager * 1e3, t_comp * 1e3, t_eager / t_comp]])


_CHILD = r"""
import json, resource, sys, time, torch
from hyperrl import transforms as T
B, L, V, mode, backward = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
torch.manual_seed(0)
logits = torch.randn(B, L, V, dtype=torch.bfloat16).requires_grad_(backward)
tokens = torch.randint(0, V, (B, L))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if mode == "chunked":
    lp, h = T.logprobs_and_entropy(logits, tokens)
else:
    logp = torch.log_softmax(logits.float(), -1)
    lp = logp.gather(-1, tokens[..., None])[..., 0]
    h = -(logp.exp() * logp).sum(-1)
if backward:
    (lp.sum() + h.sum()).backward()
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"s": dt, "extra_gib": (peak - base) / 2**20, "lp0": float(lp.flatten()[0])}))
"""


def _child(B, L, V, mode, backward):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(B), str(L), str(V), mode, str(int(backward))],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"s": float("nan"), "extra_gib": float("nan"), "error": out.stderr[-300:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_logprobs(shapes):
    rows = []
    for B, L, V, backward in shapes:
        ch, nv = _child(B, L, V, "chunked", backward), _child(B, L, V, "naive", backward)
        logits_gib = B * L * V * 2 / 2**30
        rows.append([f"[{B}, {L}] x {V}", "fwd+bwd" if backward else "fwd", round(logits_gib, 2),
                     ch["s"], nv["s"], ch["extra_gib"], nv["extra_gib"], ch["extra_gib"] / max(nv["extra_gib"], 1e-9)])
    return table(["shape", "pass", "bf16 logits GiB", "chunked s", "naive s", "chunked extra GiB",
                  "naive extra GiB", "chunked/naive mem"], rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        print(bench_advantages([4096], [8]))
        print(bench_policy_loss(64, 256))
        print(bench_logprobs([(2, 64, 4096, True)]))
        return
    adv = bench_advantages([4096, 65_536, 1_048_576], [8, 16])
    pl = bench_policy_loss(512, 4096)
    lp = bench_logprobs([(8, 1024, 151_936, False), (8, 256, 151_936, True)])
    append_results("transforms", "Group advantages (GRPO):\n\n" + adv + "\n\nPPO-clip loss forward+backward:\n\n"
                   + pl + "\n\nToken log-probs + entropy (peak extra RSS over the bf16 logits):\n\n" + lp)


if __name__ == "__main__":
    main()
