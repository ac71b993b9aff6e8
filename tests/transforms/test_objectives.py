import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.transforms import (
    OBJECTIVES,
    aggregate,
    cispo,
    clip_cov,
    gspo,
    kl_cov,
    policy_loss,
    ppo_clip,
    sapo,
    value_loss,
)
from hyperrl.transforms.advantages import compute_advantages
from tests.conftest import random_batch


def _inputs(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 2
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return lp, adv, mask


ON_POLICY = {
    "ppo_clip": {},
    "clip_higher": dict(clip_low=0.2, clip_high=0.28),
    "dual_clip": dict(dual_clip=3.0),
    "cispo": {},
    "cispo_two_sided": dict(clip_mode="two_sided"),
    "sapo": {},
    "gspo": {},
}


def _objective(name):
    alias = {"clip_higher": "ppo_clip", "dual_clip": "ppo_clip", "cispo_two_sided": "cispo"}
    return OBJECTIVES.get(alias.get(name, name))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name", list(ON_POLICY))
@given(seed=st.integers(0, 10_000))
def test_on_policy_gradient_equals_reinforce(name, agg, seed):
    lp0, adv, mask = _inputs(seed)
    # GSPO's reinforce equivalent uses the per-sequence advantage; make it constant per sequence
    if name == "gspo":
        adv = adv[:, :1].expand_as(adv).contiguous()
    lp = lp0.clone().requires_grad_(True)
    loss = aggregate(_objective(name)(lp, lp.detach(), adv, mask, **ON_POLICY[name]).loss, mask, agg)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = lp0.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(aggregate(-adv * lp2, mask, agg), lp2)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_ppo_clip_golden_and_zero_grad_in_clipped_region():
    # r = exp(lp - old). tokens: (r=1.5, A=+1) clipped at 1.2 -> L = -1.2, grad 0
    # (r=0.5, A=-1) clipped at 0.8 -> L = 0.8, grad 0; (r=1.1, A=+1) -> L = -1.1, dL/dlp = -1.1
    # (r=0.5, A=+1) unclipped -> L = -0.5 (pessimistic branch), grad -0.5
    old = torch.zeros(1, 4)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    out = ppo_clip(lp, old, adv, torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(out.loss.detach(), torch.tensor([[-1.2, 0.8, -1.1, -0.5]]))
    assert out.metrics["clipped"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
    (g,) = torch.autograd.grad(out.loss.sum(), lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.0, -1.1, -0.5]]))


def test_dual_clip_and_delta():
    # A = -1, r = 5: PPO gives max(5, 0.8*...) = 5; dual clip c=3 caps at 3 with zero grad
    lp = torch.log(torch.tensor([[5.0]])).requires_grad_(True)
    out = ppo_clip(lp, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), dual_clip=3.0)
    assert float(out.loss) == pytest.approx(3.0)
    (g,) = torch.autograd.grad(out.loss.sum(), lp)
    assert float(g) == 0.0
    # delta caps the unclipped branch: A = -1, r = 5, delta 4 -> max(4, 1.2... ) = 4
    out = ppo_clip(lp, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), delta=4.0)
    assert float(out.loss) == pytest.approx(4.0)


def test_cispo_modes_golden():
    # r = 7: upper mode weight min(7, 5) = 5; two-sided weight 1.28; loss = -w*A*lp
    lp = torch.log(torch.tensor([[7.0]]))
    m = torch.ones(1, 1, dtype=torch.bool)
    a = torch.tensor([[2.0]])
    up = cispo(lp, torch.zeros(1, 1), a, m)
    two = cispo(lp, torch.zeros(1, 1), a, m, clip_mode="two_sided")
    assert float(up.loss) == pytest.approx(-5 * 2 * float(lp))
    assert float(two.loss) == pytest.approx(-1.28 * 2 * float(lp))
    with pytest.raises(ValueError, match="clip_mode"):
        cispo(lp, torch.zeros(1, 1), a, m, clip_mode="lower")


def test_sapo_gate_golden():
    # f(1) = sigmoid(0)*4/tau = 2/tau -> A=+1: L = -2; A=-1 (tau 1.05): L = 2/1.05
    lp = torch.zeros(1, 2)
    out = sapo(lp, lp, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor([[-2.0, 2 / 1.05]]))


def test_gspo_sequence_ratio():
    # seq 0 tokens have lp-old = [0.1, 0.3] -> s = exp(0.2) on both tokens (value)
    lp = torch.tensor([[0.1, 0.3, 5.0]])
    m = torch.tensor([[True, True, False]])
    out = gspo(lp, torch.zeros(1, 3), torch.ones(1, 3), m, clip_low=1.0, clip_high=1.0)
    torch.testing.assert_close(out.metrics["ratio"][0, :2], torch.exp(torch.tensor([0.2, 0.2])))


def test_value_loss_golden():
    # V=1.0, V_old=0.5, R=0: unclipped 1.0, clipped V = 0.7 -> 0.49 => 0.5*max = 0.5
    # V=0.0, V_old=0.5, R=1: unclipped 1.0, clipped V = 0.3 -> 0.49 => 0.5
    # V=0.6, V_old=0.5, R=2: unclipped 1.96, clipped V = 0.6 -> 1.96 => 0.98
    v = torch.tensor([[1.0, 0.0, 0.6]])
    out = value_loss(v, torch.full((1, 3), 0.5), torch.tensor([[0.0, 1.0, 2.0]]), None, clip=0.2)
    torch.testing.assert_close(out.loss, torch.tensor([[0.5, 0.5, 0.98]]))


def test_clip_cov_generator_determinism_and_kl_cov():
    lp, adv, mask = _inputs(1, B=16, T=32)
    kw = dict(clip_cov_ratio=0.05, cov_lb=-10.0, cov_ub=10.0)
    a = clip_cov(lp, lp - 0.01, adv, mask, generator=torch.Generator().manual_seed(0), **kw)
    b = clip_cov(lp, lp - 0.01, adv, mask, generator=torch.Generator().manual_seed(0), **kw)
    c = clip_cov(lp, lp - 0.01, adv, mask, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a.metrics["cov_cut"], b.metrics["cov_cut"])
    assert not torch.equal(a.metrics["cov_cut"], c.metrics["cov_cut"])
    k = max(1, int(0.05 * int(mask.sum())))
    assert int(a.metrics["cov_cut"].sum()) == k
    assert (a.loss[a.metrics["cov_cut"].bool()] == 0).all()
    kc = kl_cov(lp, lp - 0.1, adv, mask, kl_cov_ratio=0.05, kl_coef=2.0)
    assert int(kc.metrics["kl_penalised"].sum()) == k


def test_policy_loss_adapter_terms_and_metrics():
    b = compute_advantages(random_batch(B=8, T=12, seed=2), "grpo")
    b["ref_logprobs"] = b["rollout_logprobs"] - 0.05
    lp = (b["rollout_logprobs"] + 0.01).requires_grad_(True)
    ent = torch.rand(8, 12)
    out = policy_loss(b, lp, objective="ppo_clip", agg="token-mean", kl_coef=0.1, entropy=ent, entropy_coef=0.01,
                      clip_high=0.28)
    assert set(out.terms) == {"loss_policy", "loss_kl", "loss_entropy"}
    assert {"clipped_frac", "approx_kl", "kl", "entropy", "ratio_mean"} <= set(out.metrics)
    assert all(not v.requires_grad for v in out.metrics.values())
    out.loss.backward()
    assert lp.grad is not None and (lp.grad[~b["action_mask"]] == 0).all()
    with pytest.raises(KeyError, match="advantages: missing"):
        policy_loss(random_batch(), lp)
    with pytest.raises(KeyError, match="ref_logprobs"):
        policy_loss(compute_advantages(random_batch(B=8, T=12, seed=2), "grpo"), lp, kl_coef=0.1)
    with pytest.raises(ValueError, match="logprobs: shape"):
        policy_loss(b, lp[:, :3])


@pytest.mark.parametrize("name", OBJECTIVES.names())
def test_masked_positions_never_affect_loss(name):
    b = compute_advantages(random_batch(B=6, T=10, seed=4, holes=True), "grpo")
    m = b["action_mask"]
    lp = b["rollout_logprobs"] + 0.05
    noisy = torch.where(m, lp, torch.randn(6, 10) * 50)
    required = {"dro": {"beta": 0.1}}.get(name, {})  # verl requires dro_beta too
    kw = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else dict(required)
    a = policy_loss(b, lp, objective=name, **kw).loss
    kw = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else dict(required)
    c = policy_loss(b, noisy, objective=name, **kw).loss
    torch.testing.assert_close(a, c)
