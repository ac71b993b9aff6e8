import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.transforms import AGGREGATIONS, Normalizer, aggregate, policy_loss
from hyperrl.transforms.advantages import compute_advantages
from tests.conftest import random_batch

MODES = AGGREGATIONS.names()


def test_golden_values():
    # L = [[1, 2, 3], [4, 0, 0]], m = [[1, 1, 0], [1, 0, 0]]
    # token-mean = (1+2+4)/3; token-sum = 7; seq-mean-token-mean = (1.5 + 4)/2 = 2.75
    # seq-mean-token-sum = (3 + 4)/2 = 3.5; -norm with L_const 4 = 7/(2*4); length-weighted = (1.5*2+4*1)/2
    L = torch.tensor([[1.0, 2, 3], [4, 0, 0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert float(aggregate(L, m, "token-mean")) == pytest.approx(7 / 3)
    assert float(aggregate(L, m, "token-sum")) == pytest.approx(7)
    assert float(aggregate(L, m, "seq-mean-token-mean")) == pytest.approx(2.75)
    assert float(aggregate(L, m, "seq-mean-token-sum")) == pytest.approx(3.5)
    assert float(aggregate(L, m, "seq-mean-token-sum-norm", length_const=4)) == pytest.approx(7 / 8)
    assert float(aggregate(L, m, "seq-mean-length-weighted")) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="length_const"):
        aggregate(L, m, "seq-mean-token-sum-norm")
    with pytest.raises(KeyError, match="unknown aggregation mode"):
        aggregate(L, m, "token_mean")


def test_fully_masked_sequences_excluded():
    L = torch.tensor([[2.0, 2.0], [9.0, 9.0]])
    m = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    assert float(aggregate(L, m, "seq-mean-token-mean")) == 2.0


def _split(n, cuts):
    bounds = sorted({0, n, *[c % (n + 1) for c in cuts]})
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "cispo"])
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 20), max_size=4), ranks=st.integers(1, 3))
def test_micro_batch_and_dp_invariance(mode, objective, seed, cuts, ranks):
    """Σ over (ranks × micro-batches) of the loss with global normalisers == full-batch loss,
    and so is the gradient (what gradient accumulation + DP all-reduce-sum computes)."""
    B, T = 12, 10
    batch = compute_advantages(random_batch(B=B, T=T, seed=seed, holes=True), "grpo")
    lp0 = batch["rollout_logprobs"] + 0.1 * torch.randn(B, T, generator=torch.Generator().manual_seed(seed))
    norm = Normalizer.from_mask(batch["action_mask"], length_const=T)
    kw = dict(objective=objective, agg=mode, normalizer=norm)
    lp = lp0.clone().requires_grad_(True)
    full = policy_loss(batch, lp, **kw).loss
    (g_full,) = torch.autograd.grad(full, lp)

    # simulated DP ranks: contiguous shards; each rank then splits into micro-batches
    shard = [(r * B // ranks, (r + 1) * B // ranks) for r in range(ranks)]
    lp = lp0.clone().requires_grad_(True)
    # the global normaliser is the sum of the per-micro-batch ones (an all-reduce in real DP)
    pieces = [(lo + a, lo + b) for lo, hi in shard for a, b in _split(hi - lo, cuts)]
    total_norm = Normalizer(0.0, 0.0, T)
    for a, b in pieces:
        total_norm = total_norm + Normalizer.from_mask(batch["action_mask"][a:b], length_const=T)
    assert float(total_norm.num_tokens) == float(norm.num_tokens)
    acc = sum(policy_loss(batch[a:b], lp[a:b], objective=objective, agg=mode, normalizer=total_norm).loss
              for a, b in pieces)
    (g_acc,) = torch.autograd.grad(acc, lp)
    torch.testing.assert_close(acc, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_acc, g_full, atol=1e-6, rtol=1e-5)


def test_local_normaliser_is_wrong_under_accumulation():
    """The bug peers shipped: averaging per-micro-batch token means differs from the full batch."""
    batch = compute_advantages(random_batch(B=8, T=10, seed=11, holes=True), "grpo")
    lp = batch["rollout_logprobs"] + 0.3
    full = policy_loss(batch, lp).loss
    naive = (policy_loss(batch[:3], lp[:3]).loss + policy_loss(batch[3:], lp[3:]).loss) / 2
    assert abs(float(full - naive)) > 1e-4
