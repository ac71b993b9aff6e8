"""The transforms demo: the GRPO, DAPO, GSPO, Dr. GRPO and CISPO recipes' losses on a synthetic batch,
and group advantages vectorised vs a per-sample loop (what ``hyperrl demo`` prints)."""

from __future__ import annotations

import time

import torch

from hyperrl import transforms as T
from hyperrl.config import load_config
from hyperrl.loop.pipeline import build_pipeline
from hyperrl.trajectory import make_trajectory

# the library's own recipes (hyperrl.config.RECIPES), bound as the trainer binds them
DEMO_RECIPES = ("grpo", "dapo", "gspo", "dr_grpo", "cispo")


def synthetic_batch(B: int = 64, T_len: int = 48, group_size: int = 8, seed: int = 0):
    """A right-padded synthetic trajectory: 8-token prompts, random-length responses."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, T_len + 1, (B,), generator=g)
    ar = torch.arange(T_len)
    attn = ar[None] < lengths[:, None]
    act = attn & (ar[None] >= 8)
    return make_trajectory(
        tokens=torch.randint(1, 100, (B, T_len), generator=g) * attn,
        attention_mask=attn,
        action_mask=act,
        rollout_logprobs=torch.where(act, -torch.rand(B, T_len, generator=g) * 2, 0.0),
        policy_version=torch.zeros(B, dtype=torch.int64),
        group_id=torch.arange(B) // group_size,
        reward=torch.bernoulli(torch.full((B,), 0.4), generator=g),
    )


def _loop_grpo(scores: list[float], gids: list[int], eps: float = 1e-6) -> list[float]:
    groups: dict[int, list[float]] = {}
    for s, gid in zip(scores, gids):
        groups.setdefault(gid, []).append(s)
    out = []
    for s, gid in zip(scores, gids):
        xs = groups[gid]
        mu = sum(xs) / len(xs)
        sd = (sum((x - mu) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5
        out.append(0.0 if len(xs) < 2 or max(xs) == min(xs) else (s - mu) / (sd + eps))
    return out


def main() -> None:
    """Print each recipe's loss and gradient norm, and the vectorised vs per-sample advantage timing."""
    batch = synthetic_batch()
    lp = (batch["rollout_logprobs"] + 0.05 * torch.randn(batch["tokens"].shape)).requires_grad_(True)
    print(f"synthetic batch: B={batch.batch_size[0]}, T={batch['tokens'].shape[1]}, "
          f"action tokens={int(batch['action_mask'].sum())}")
    print(f"{'recipe':<9} {'loss':>9} {'clip_frac':>9} {'approx_kl':>9} {'|grad|':>9}")
    for name in DEMO_RECIPES:
        p = build_pipeline(load_config(None, [f"--algo.recipe={name}"]).algo)
        b = p.transform(batch)
        norm = T.Normalizer.from_mask(b["action_mask"], length_const=b["tokens"].shape[1])
        out = T.policy_loss(b, lp, normalizer=norm, **p.loss_kwargs(0.0))  # no reference model here: β = 0
        (g,) = torch.autograd.grad(out.loss, lp)
        print(f"{name:<9} {float(out.loss.detach()):>9.4f} {float(out.metrics.get('clipped_frac', 0.0)):>9.4f} "
              f"{float(out.metrics['approx_kl']):>9.2e} {float(g.norm()):>9.4f}")
    B = 65_536
    s = torch.bernoulli(torch.full((B,), 0.3))
    gids = torch.arange(B) // 16
    t0 = time.perf_counter()
    vec = T.grpo_advantages(s, gids)
    t1 = time.perf_counter()
    ref = _loop_grpo(s.tolist(), gids.tolist())
    t2 = time.perf_counter()
    diff = float((vec - torch.tensor(ref)).abs().max())
    print(f"\nGRPO advantages, {B} samples in groups of 16: vectorised {1e3 * (t1 - t0):.2f} ms, "
          f"per-sample loop {1e3 * (t2 - t1):.0f} ms ({(t2 - t1) / (t1 - t0):.0f}x), max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
