"""Transforms benchmark, side by side in one run (results appended to benchmarks/RESULTS.md).

1. GRPO group advantages at B = 4,096 / 65,536 / 1,048,576 (groups of 8 and 16): hyperrl's
   segment-sum kernel vs a per-sample Python loop of the same math, and verl 0.9.1's ``grpo`` /
   ``grpo_vectorized`` when verl imports (``pip install -e '.[bench]'`` or ``--no-deps verl``).
2. PPO-clip policy loss forward+backward at [512, 4096]: eager vs ``torch.compile``.
3. Token log-probs + entropy at [8, 1024] × 151,936 (bf16 logits): chunked fp32 vs naive fp32
   ``log_softmax`` — time and peak extra RSS, each in a fresh subprocess.
4. The 2026 objectives and corrections (issue 31) forward+backward at [512, 4096], eager and compiled, against
   one memory pass and verl 0.9.1's functions where verl has them (``--kernels-only``: this section alone).

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


def _memory_pass_s(B, Tn) -> float:
    """One memory pass of a loss's fwd + bwd at ``[B, Tn]``: reading its inputs (log-probs, old log-probs,
    advantages fp32, the mask) and writing the gradient (fp32), at this machine's measured copy bandwidth."""
    big = torch.ones(64 * 2**20 // 4)  # touched pages (an untouched buffer reads the zero page)
    dst = torch.zeros_like(big)
    bw = 2 * big.numel() * 4 / timeit(lambda: dst.copy_(big), repeat=7)  # read + write bytes per second
    return (4 * 4 + 1) * B * Tn / bw


def _verl_policy_loss(name, **policy_loss):
    try:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn
        from verl.workers.config import ActorConfig, PolicyLossConfig

        cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_c=3.0,
                          policy_loss=PolicyLossConfig(loss_mode=name, **policy_loss))
        fn = get_policy_loss_fn(name)
        return lambda lp, old, adv, mask: fn(old, lp, adv, mask.float(), "token-mean", cfg)[0]
    except Exception as e:  # noqa: BLE001 - the peer is optional
        print(f"[verl {name} unavailable: {type(e).__name__}: {str(e)[:80]}]")
        return None


def bench_2026_kernels(B, Tn):
    """Each 2026 objective / correction (issue 31) as a token-mean loss, forward + backward at ``[B, Tn]``:
    eager and ``torch.compile``, beside PPO-clip, one memory pass, and verl 0.9.1's function where verl has
    it (its eager code, the same inputs)."""
    g = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(B, Tn, generator=g) * 2
    old = lp0 + 0.05 * torch.randn(B, Tn, generator=g)
    roll = old + 0.05 * torch.randn(B, Tn, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, Tn).contiguous()
    mask = torch.rand(B, Tn, generator=g) > 0.1
    agg = T.aggregate

    keep = T.m2po_global_mask(roll - old, mask)  # M2PO's step mask: computed once per step, not per loss call

    def corrected(name, **kw):
        fn = T.CORRECTIONS.build(name, **kw)

        def loss(x):
            from tensordict import TensorDict

            td = TensorDict({"rollout_logprobs": roll, "old_logprobs": old, "action_mask": mask,
                             "advantages": adv, "logprobs": x.detach()}, batch_size=[B])
            if name == "m2po":
                td.set("m2po_keep", keep)
            c = fn(td)
            return agg(T.ppo_clip(x, old, adv, c.mask).loss * c.weights, c.mask, "token-mean")
        return loss

    kernels = {
        "ppo_clip (reference)": (lambda x: agg(T.ppo_clip(x, old, adv, mask).loss, mask, "token-mean"), None),
        "dppo_tv": (lambda x: agg(T.dppo_tv(x, old, adv, mask).loss, mask, "token-mean"), _verl_policy_loss("dppo_tv")),
        "dppo_kl": (lambda x: agg(T.dppo_kl(x, old, adv, mask).loss, mask, "token-mean"), _verl_policy_loss("dppo_kl")),
        "dro": (lambda x: agg(T.dro(x, old, adv, mask, beta=0.1).loss, mask, "token-mean"),
                _verl_policy_loss("dro", dro_beta=0.1)),
        "topr": (lambda x: agg(T.topr(x, old, adv, mask).loss, mask, "token-mean"), None),
        "ppo + icepop": (corrected("icepop"), None),
        "ppo + kpop": (corrected("kpop"), None),
        "ppo + opsm": (corrected("opsm"), None),
        "ppo + m2po (step mask given)": (corrected("m2po"), None),
        "ppo + m2po_local (sort)": (corrected("m2po_local"), None),
    }
    mem = _memory_pass_s(B, Tn)
    rows = []

    def step(fn):
        x = lp0.clone().requires_grad_(True)
        fn(x).backward()

    for name, (fn, peer) in kernels.items():
        t_eager = timeit(lambda: step(fn))
        try:
            comp = torch.compile(fn)
            t_comp = timeit(lambda: step(comp), warmup=2)
        except Exception as e:  # noqa: BLE001 - a data-dependent kernel may not compile
            print(f"[{name}: torch.compile failed: {type(e).__name__}]")
            t_comp = float("nan")
        row = [name, t_eager * 1e3, t_comp * 1e3, t_comp / mem]
        if peer is not None:
            t_peer = timeit(lambda: step(lambda x: peer(x, old, adv, mask)))
            x = lp0.clone().requires_grad_(True)
            gap = float((fn(x) - peer(x, old, adv, mask)).detach().abs())
            row += [t_peer * 1e3, t_peer / t_eager, gap]
        else:
            row += ["—", "—", "—"]
        rows.append(row)
    from hyperrl.transforms.advantages import optimal_token_baseline_advantages

    ends = torch.randint(17, Tn + 1, (B,), generator=g)  # a 16-token prompt, responses of 1 … Tn − 16 tokens
    cols = torch.arange(Tn)[None]
    otb_mask = (cols >= 16) & (cols < ends[:, None])
    scores = torch.zeros(B, Tn).index_put_((torch.arange(B), ends - 1), torch.randn(B, generator=g))
    otb_in = (scores, old, torch.rand(B, Tn, generator=g) * 0.5, otb_mask, torch.arange(B) // 16)
    t_otb = timeit(lambda: optimal_token_baseline_advantages(*otb_in))
    otb_row = ["optimal_token_baseline advantages (no grad)", t_otb * 1e3, "—", t_otb / mem, "—", "—", "—"]
    try:  # verl's, on the response columns (its tensors are left-aligned responses) — the same values
        from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage as verl_otb

        vin = (otb_in[0][:, 16:], otb_mask[:, 16:].float(), (torch.arange(B) // 16).numpy(),
               (old * otb_mask)[:, 16:], otb_in[2][:, 16:])
        t_v = timeit(lambda: verl_otb(*vin))
        ours = optimal_token_baseline_advantages(otb_in[0], old * otb_mask, *otb_in[2:])[0][:, 16:]
        otb_row[4:] = [t_v * 1e3, t_v / t_otb, float((verl_otb(*vin)[0] - ours).abs().max())]
    except Exception as e:  # noqa: BLE001 - the peer is optional
        print(f"[verl optimal_token_baseline unavailable: {type(e).__name__}]")
    rows.append(otb_row)
    t_m2 = timeit(lambda: T.m2po_global_mask(roll - old, mask))
    rows.append(["m2po step mask (sort, once per step)", t_m2 * 1e3, "—", t_m2 / mem, "—", "—", "—"])
    return table(["kernel", "eager ms", "compiled ms", "compiled / memory pass", "verl 0.9.1 ms",
                  "verl / hyperrl eager", "gap vs verl"], rows) + f"\n\none memory pass: {mem * 1e3:.2f} ms"


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
    ap.add_argument("--kernels-only", action="store_true")
    args = ap.parse_args()
    if args.kernels_only:
        k26 = bench_2026_kernels(512, 4096)
        print(k26)
        append_results("transforms --kernels-only", "The 2026 kernels, token-mean loss forward+backward:\n\n" + k26)
        return
    if args.quick:
        print(bench_advantages([4096], [8]))
        print(bench_policy_loss(64, 256))
        print(bench_logprobs([(2, 64, 4096, True)]))
        print(bench_2026_kernels(64, 256))
        return
    adv = bench_advantages([4096, 65_536, 1_048_576], [8, 16])
    pl = bench_policy_loss(512, 4096)
    lp = bench_logprobs([(8, 1024, 151_936, False), (8, 256, 151_936, True)])
    k26 = bench_2026_kernels(512, 4096)
    append_results("transforms", "Group advantages (GRPO):\n\n" + adv + "\n\nPPO-clip loss forward+backward:\n\n"
                   + pl + "\n\nToken log-probs + entropy (peak extra RSS over the bf16 logits):\n\n" + lp
                   + "\n\nThe 2026 kernels, token-mean loss forward+backward:\n\n" + k26)


if __name__ == "__main__":
    main()
