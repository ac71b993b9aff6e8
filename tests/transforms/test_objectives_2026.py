"""The 2026 objectives and masks (issue 31): DPPO-TV / DPPO-KL (verl 0.9), DRO (verl 0.9), TOPR (ROLL) and the
IcePop correction — golden values derived by hand, on-policy equivalence with REINFORCE, and masks that cut
the gradient."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.transforms import CORRECTIONS, aggregate, dppo_kl, dppo_tv, dro, policy_loss, topr
from hyperrl.transforms.advantages import compute_advantages
from hyperrl.transforms.correction import masked_is, mismatch_log_ratio
from tests.conftest import random_batch

L = math.log


def _t(*xs):
    return torch.tensor([list(xs)], dtype=torch.float32)


def test_dppo_tv_golden():
    # p_old → p per token, A:  0.2 → 0.5, A=+1: p − p_old = 0.3 > ε_high 0.2 → masked (0)
    #                          0.2 → 0.5, A=−1: 0.3 ≥ −0.2 → kept: −A·min(2.5, 3)·log 0.5 = 2.5·(−0.693147) = −1.732868
    #                          0.4 → 0.1, A=+1: −0.3 ≤ 0.2 → kept: −1·0.25·log 0.1 = 0.575646
    #                          0.4 → 0.1, A=−1: −0.3 < −0.2 → masked (0)
    #                          0.1 → 0.35, A=−1: kept, r = 3.5 truncated at 3: 3·log 0.35 = 3·(−1.049822) = −3.149466
    lp = _t(L(0.5), L(0.5), L(0.1), L(0.1), L(0.35)).requires_grad_(True)
    old = _t(L(0.2), L(0.2), L(0.4), L(0.4), L(0.1))
    adv = _t(1.0, -1.0, 1.0, -1.0, -1.0)
    out = dppo_tv(lp, old, adv, torch.ones_like(adv, dtype=torch.bool))
    torch.testing.assert_close(out.loss.detach(), _t(0.0, -1.732868, 0.575646, 0.0, -3.149466), atol=1e-5, rtol=0)
    assert out.metrics["clipped"].tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    assert out.metrics["truncated"].tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    out.loss.sum().backward()  # masked tokens: no gradient; kept ones: −A·w
    torch.testing.assert_close(lp.grad, _t(0.0, 2.5, -0.25, 0.0, 3.0), atol=1e-5, rtol=0)


def test_dppo_kl_golden():
    # p_old 0.2 → p 0.5: KL_bin = 0.2·log(0.2/0.5) + 0.8·log(0.8/0.5) = −0.183258 + 0.376003 = 0.192745
    #   A=+1, ε_high 0.2: 0.192745 ≤ 0.2 → kept: −1·2.5·log 0.5 = 1.732868; ε_high 0.1: p > p_old → masked
    #   A=−1, ε_low 0.1: KL > 0.1 but p ≥ p_old → kept: 2.5·log 0.5 = −1.732868
    lp, old = _t(L(0.5), L(0.5)), _t(L(0.2), L(0.2))
    adv, m = _t(1.0, -1.0), torch.ones(1, 2, dtype=torch.bool)
    torch.testing.assert_close(dppo_kl(lp, old, adv, m).loss, _t(1.732868, -1.732868), atol=1e-5, rtol=0)
    out = dppo_kl(lp, old, adv, m, clip_high=0.1, clip_low=0.1)
    torch.testing.assert_close(out.loss, _t(0.0, -1.732868), atol=1e-5, rtol=0)
    # p_old 0.5 → p 0.2, A=−1: KL_bin = 0.5·log(2.5) + 0.5·log(0.5/0.8) = 0.458145 − 0.235002 = 0.223144 > 0.2 and
    # p < p_old → masked; A=+1: p ≤ p_old → kept: −1·0.4·log 0.2 = 0.643775
    out = dppo_kl(_t(L(0.2), L(0.2)), _t(L(0.5), L(0.5)), _t(-1.0, 1.0), m)
    torch.testing.assert_close(out.loss, _t(0.0, 0.643775), atol=1e-5, rtol=0)


def test_dro_golden():
    # lp = log 0.5, old = log 0.25 (d = log 2 = 0.693147), A = 2, β = 0.1:
    #   L = −(lp·A − β/2·d²) = −(−1.386294 − 0.05·0.480453) = 1.410317;  ∂L/∂lp = −(A − β·d) = −1.930685
    lp = _t(L(0.5)).requires_grad_(True)
    out = dro(lp, _t(L(0.25)), _t(2.0), torch.ones(1, 1, dtype=torch.bool), beta=0.1)
    torch.testing.assert_close(out.loss.detach(), _t(1.410317), atol=1e-5, rtol=0)
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, _t(-1.930685), atol=1e-5, rtol=0)


def test_topr_golden_token_and_sequence():
    # A = +2 at lp = log 0.5: −A·lp = 1.386294 whatever the ratio (r = 2 here)
    # A = −1, r = 0.5/0.25 = 2 → clip 1: −(−1)·1·log 0.5 = −0.693147
    # A = −1, r = 0.5/1.0 = 0.5 → 0.5: 0.5·log 0.5 = −0.346574, gradient −w·A = 0.5
    lp = _t(L(0.5), L(0.5), L(0.5)).requires_grad_(True)
    old = _t(L(0.25), L(0.25), 0.0)
    out = topr(lp, old, _t(2.0, -1.0, -1.0), torch.ones(1, 3, dtype=torch.bool))
    torch.testing.assert_close(out.loss.detach(), _t(1.386294, -0.693147, -0.346574), atol=1e-5, rtol=0)
    assert out.metrics["tapered"].tolist() == [[0.0, 0.0, 1.0]]
    out.loss.sum().backward()
    torch.testing.assert_close(lp.grad, _t(-2.0, 1.0, 0.5), atol=1e-6, rtol=0)
    # sequence level: Σ_t m·(lp − old) = log 2 + log 0.5 + (masked) = 0 → w = 1 on every negative token
    m = torch.tensor([[True, True, False]])
    seq = topr(lp.detach(), _t(L(0.25), 0.0, -5.0), _t(-1.0, -1.0, -1.0), m, level="sequence")
    torch.testing.assert_close(seq.metrics["ratio"], torch.ones(1, 3))
    with pytest.raises(ValueError, match="level='tokens'"):
        topr(lp, old, _t(1.0, 1.0, 1.0), m, level="tokens")


ON_POLICY = {"dppo_tv": (dppo_tv, {}), "dppo_kl": (dppo_kl, {}), "dro": (dro, {"beta": 0.3}), "topr": (topr, {}),
             "topr_seq": (topr, {"level": "sequence"})}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", list(ON_POLICY))
@given(seed=st.integers(0, 10_000))
def test_on_policy_gradient_equals_reinforce(name, agg, seed):
    """At ``lp = old`` every token is inside DPPO's trust region (p − p_old = 0, KL_bin = 0), TOPR's weight is 1
    and DRO's penalty has zero gradient: all are REINFORCE, −A·∇lp."""
    g = torch.Generator().manual_seed(seed)
    lp0 = -torch.rand(5, 7, generator=g) * 3
    adv = torch.randn(5, 7, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    fn, kw = ON_POLICY[name]
    lp = lp0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(aggregate(fn(lp, lp.detach(), adv, mask, **kw).loss, mask, agg), lp)
    ref = lp0.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(aggregate(-adv * ref, mask, agg), ref)
    torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)


@given(seed=st.integers(0, 10_000), shift=st.floats(-2.0, 2.0))
def test_dppo_masks_exactly_the_tokens_outside_the_trust_region(seed, shift):
    """A token keeps a gradient iff it is inside the region on the side of its advantage (TV), and every kept
    token's gradient is −A·min(r, c)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=g) * 3
    lp = (old + shift * torch.randn(4, 6, generator=g)).clamp(max=-1e-3).requires_grad_(True)
    adv = torch.randn(4, 6, generator=g)
    dppo_tv(lp, old, adv, torch.ones(4, 6, dtype=torch.bool)).loss.sum().backward()
    dp = lp.detach().exp() - old.exp()
    inside = torch.where(adv > 0, dp <= 0.2, dp >= -0.2)
    w = torch.exp(lp.detach() - old).clamp(max=3.0)
    torch.testing.assert_close(lp.grad, torch.where(inside, -adv * w, 0.0), atol=1e-5, rtol=1e-5)


@given(seed=st.integers(0, 10_000))
def test_icepop_is_token_level_mis_with_its_window(seed):
    b = random_batch(B=6, T=9, seed=seed % 50)
    g = torch.Generator().manual_seed(seed)
    b = b.set("old_logprobs", b["rollout_logprobs"] + torch.randn(6, 9, generator=g))
    got = CORRECTIONS.build("icepop")(b)
    want = masked_is(mismatch_log_ratio(b["old_logprobs"], b["rollout_logprobs"], b["action_mask"]),
                     b["action_mask"], lo=0.5, hi=5.0, level="token")
    assert torch.equal(got.weights, want.weights) and torch.equal(got.mask, want.mask)


def test_the_new_objectives_run_through_policy_loss():
    b = compute_advantages(random_batch(B=6, T=10, seed=3), "grpo")
    lp = b["rollout_logprobs"] + 0.1
    for name, kw in (("dppo_tv", {}), ("dppo_kl", {}), ("dro", {"beta": 0.1}), ("topr", {})):
        out = policy_loss(b, lp, objective=name, **kw)
        assert torch.isfinite(out.loss) and "loss_policy" in out.terms


def test_kpop_golden():
    # p = 0.5 (proximal), q = 0.25 (behaviour): D_B(p‖q) = 0.5·ln 2 + 0.5·ln(0.5/0.75) = 0.143841,
    # D_B(q‖p) = 0.25·ln 0.5 + 0.75·ln 1.5 = 0.130812; max 0.143841: upper 0.14 drops it, 0.15 keeps it with
    # the decoupled weight 0.5 / 0.25 = 2
    from hyperrl.transforms.correction import binary_kl

    p, q = torch.tensor([0.5]), torch.tensor([0.25])
    torch.testing.assert_close(binary_kl(p, q), torch.tensor([0.143841]), atol=1e-6, rtol=0)
    torch.testing.assert_close(binary_kl(q, p), torch.tensor([0.130812]), atol=1e-6, rtol=0)
    from tensordict import TensorDict

    m = torch.tensor([[False, True, False]])
    b = TensorDict({"action_mask": m, "rollout_logprobs": _t(0.0, L(0.25), 0.0), "old_logprobs": _t(0.0, L(0.5), 0.0)},
                   batch_size=[1])
    tight, loose = CORRECTIONS.build("kpop", upper=0.14)(b), CORRECTIONS.build("kpop", upper=0.15)(b)
    assert tight.mask.tolist() == [[False, False, False]] and float(tight.weights.sum()) == 0
    assert loose.mask.tolist() == [[False, True, False]]
    torch.testing.assert_close(loose.weights, _t(0.0, 2.0, 0.0))


def test_opsm_golden():
    # behaviour [−1, −1] vs current [−1.5, −1.5]: mean log-ratio 0.5 > δ. Row 0 (A = −1): dropped; row 1
    # (A = +1): kept; row 2 (A = −1, on-policy: 0 ≤ δ): kept
    from hyperrl.transforms.correction import opsm_mask

    behave = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    cur = torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [-1.0, -1.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    keep = opsm_mask(behave, cur, adv, torch.ones(3, 2, dtype=torch.bool), delta=1e-4)
    assert keep.tolist() == [[False, False], [True, True], [True, True]]
    assert opsm_mask(behave, cur, adv, torch.ones(3, 2, dtype=torch.bool), delta=0.6).all()


def test_m2po_golden():
    # log r = 3, 2, 1, 0.1 → m2 = 9, 4, 1, 0.01; tail means 3.5025, 1.67, 0.505, 0.01: τ = 2 drops the 9 only;
    # τ = 1e-3 (nothing below): all but the smallest dropped
    from hyperrl.transforms.correction import m2po_mask

    lr, m = torch.tensor([[0.0, 3.0, 2.0], [1.0, 0.1, 7.0]]), torch.tensor([[False, True, True], [True, True, False]])
    assert m2po_mask(lr, m, tau=2.0).tolist() == [[False, False, True], [True, True, False]]
    assert m2po_mask(lr, m, tau=1e-3).tolist() == [[False, False, False], [False, True, False]]
    with pytest.raises(ValueError, match=r"algo.correction.tau=0"):
        m2po_mask(lr, m, tau=0)


@given(seed=st.integers(0, 10_000), tau=st.floats(1e-3, 2.0))
def test_m2po_drops_the_largest_until_the_kept_second_moment_is_below_tau(seed, tau):
    from hyperrl.transforms.correction import m2po_mask

    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(4, 9, generator=g)
    m = torch.rand(4, 9, generator=g) > 0.3
    keep = m2po_mask(lr, m, tau=tau)
    assert not (keep & ~m).any()
    m2 = lr.square()
    kept, dropped = m2[keep], m2[m & ~keep]
    if len(dropped):
        assert float(dropped.min()) >= float(kept.max())  # only the largest are dropped
    if len(kept) > 1:
        assert float(kept.mean()) < tau  # the bound holds (else only the smallest one is left)
    if len(dropped) and len(kept):  # minimal: keeping one more (the smallest dropped) would break it
        assert float(torch.cat([kept, dropped.min()[None]]).mean()) >= tau


# ---------------------------------------------------------------- the optimal token baseline (verl 0.9)


def _otb(token_rewards, old, spp, mask, gid, **kw):
    from hyperrl.transforms.advantages import optimal_token_baseline_advantages

    return optimal_token_baseline_advantages(token_rewards, old, spp, mask, gid, **kw)


def test_optimal_token_baseline_golden():
    # one prompt token, then responses. Group 0: row 0 (2 tokens, reward 1), row 1 (3 tokens, reward 2);
    # group 1: row 2 alone (2 tokens, reward 3). Σπ² = 0.5 everywhere; π = 0.5 except row 1's first (0.25):
    # w = 1 − 2π + Σπ² = 0.5, but 1.0 there. W: row 0 [0.5, 1.0]; row 1 [1.0, 1.5, 2.0].
    # B_0 = (1·0.5 + 2·1.0)/(0.5 + 1.0) = 5/3; B_1 = (1·1.0 + 2·1.5)/(1.0 + 1.5) = 1.6;
    # B_2 = 2·2.0/2.0 = 2, zeroed (row 1 alone is the longest: past the second-longest's 2 tokens).
    # A row 0 = [1 − 5/3, 1 − 1.6] = [−2/3, −0.6]; row 1 = [1/3, 0.4, 2]; row 2 (a group of one) = G = [3, 3].
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.zeros(3, 4)
    rewards[0, 2], rewards[1, 3], rewards[2, 2] = 1.0, 2.0, 3.0
    pi = torch.full((3, 4), 0.5)
    pi[1, 1] = 0.25
    adv, ret = _otb(rewards, pi.log() * mask, torch.full((3, 4), 0.5), mask, torch.tensor([0, 0, 1]))
    want = torch.tensor([[0, -2 / 3, -0.6, 0], [0, 1 / 3, 0.4, 2.0], [0, 3.0, 3.0, 0]])
    assert torch.allclose(adv, want, atol=1e-6)
    assert torch.equal(ret[mask], torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0]))
    adv, _ = _otb(rewards, pi.log() * mask, torch.full((3, 4), 0.5), mask, torch.tensor([0, 0, 1]),
                  handle_zero_tail=False)
    assert adv[1, 3] == pytest.approx(0.0, abs=1e-6)  # B_2 = 2 kept: G − B = 0


@given(st.lists(st.floats(-3, 3), min_size=8, max_size=8), st.floats(-5, 5), st.integers(1, 6))
def test_optimal_token_baseline_properties(scores, shift, length):
    """Equal lengths and a constant w: B_t is the group mean (A = s − μ_g, Dr. GRPO's advantage on every token);
    and a constant added to a group's rewards moves only its baseline (the advantages do not change)."""
    B, P = 8, 2
    mask = torch.zeros(B, P + length, dtype=torch.bool)
    mask[:, P:] = True
    s = torch.tensor(scores)
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.zeros(B, P + length)
    rewards[:, -1] = s
    old = torch.full_like(rewards, math.log(0.3)) * mask
    spp = torch.full_like(rewards, 0.4)
    adv, _ = _otb(rewards, old, spp, mask, gid)
    mean = torch.stack([s[:4].mean()] * 4 + [s[4:].mean()] * 4)
    assert torch.allclose(adv[:, P:], (s - mean)[:, None].expand(B, length), atol=1e-5)
    shifted = rewards.clone()
    shifted[:4, -1] += shift
    spp_varied = spp + 0.3 * torch.rand(spp.shape)
    a1, _ = _otb(rewards, old, spp_varied, mask, gid)
    a2, _ = _otb(shifted, old, spp_varied, mask, gid)
    assert torch.allclose(a1, a2, atol=1e-4)


def test_optimal_token_baseline_refuses_rows_of_a_group_that_start_apart():
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]], dtype=torch.bool)
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"group_id 7: its rows start their responses at different columns"):
        _otb(z, z, z, mask, torch.tensor([7, 7]))


def test_sum_pi_squared_is_the_distributions_collision_probability():
    """On the action window (from the batch's first action position, 3 here: row 1's) Σπ² equals the squared
    softmax of a full forward; 0 before it (no logits computed there)."""
    from tensordict import TensorDict

    from hyperrl.loop.forward import plain_sum_pi_squared
    from hyperrl.models import tiny_qwen3

    model = tiny_qwen3(20, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64, seed=0)
    tokens = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(2, 6, dtype=torch.bool)
    act = torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    batch = TensorDict({"tokens": tokens, "attention_mask": attn, "action_mask": act}, batch_size=[2])
    got = plain_sum_pi_squared(model, batch, 0.7)
    p = torch.softmax(model(input_ids=tokens).logits[:, :-1].float() / 0.7, -1)
    assert got.shape == (2, 6) and torch.equal(got[:, :3], torch.zeros(2, 3))
    assert torch.allclose(got[:, 3:], p.square().sum(-1)[:, 2:], atol=1e-6)
    assert bool(((got[:, 3:] > 1 / 20 - 1e-6) & (got[:, 3:] <= 1)).all())  # between uniform (1/V) and one-hot


# ---------------------------------------------------------------- M2PO over the whole step


def _lr_batch(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(B, T, generator=g) * 0.4
    m = torch.rand(B, T, generator=g) < 0.7
    return lr, m


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tau", [1e-3, 0.04, 0.1, 10.0])
def test_m2po_global_is_the_count_rule_without_ties_and_does_not_depend_on_sharding(seed, tau):
    from hyperrl.transforms.correction import m2po_global_mask, m2po_mask

    lr, m = _lr_batch(seed)
    whole = m2po_global_mask(lr, m, tau=tau)
    assert torch.equal(whole, m2po_mask(lr, m, tau=tau))  # distinct float values: the threshold drops the same
    # two "ranks" (rows round-robin), each cutting at the threshold of both ranks' values
    shards = [torch.arange(6)[r::2] for r in range(2)]

    def gather(_):
        return torch.cat([lr[i].square()[m[i]] for i in shards])

    for i in shards:
        assert torch.equal(m2po_global_mask(lr[i], m[i], tau=tau, gather=gather), whole[i])


def test_m2po_global_drops_ties_with_the_threshold_alike():
    from hyperrl.transforms.correction import m2po_global_mask, m2po_mask, m2po_threshold

    # m2 = [4, 4, 0.01, 0.01]; τ = 1: tail means 2.005, 1.34, 0.01 → drop the first 2 (both 4s: θ = 4)
    lr = torch.tensor([[2.0, -2.0, 0.1, -0.1]])
    assert m2po_threshold(lr.square().flatten(), tau=1.0) == pytest.approx(4.0)
    assert m2po_global_mask(lr, torch.ones(1, 4, dtype=torch.bool), tau=1.0).tolist() == [[False, False, True, True]]
    # τ = 1.5: 2.005 ≥ 1.5 but the tail from the second 4 is 1.34 < 1.5 → the count rule drops one 4 (which one
    # depends on the order); the value rule drops both, whatever the order or sharding
    assert m2po_mask(lr, torch.ones(1, 4, dtype=torch.bool), tau=1.5).sum() == 3
    assert m2po_global_mask(lr, torch.ones(1, 4, dtype=torch.bool), tau=1.5).tolist() == [[False, False, True, True]]
    assert m2po_threshold(torch.tensor([0.01, 0.02]), tau=1.0) == math.inf  # under τ already: nothing dropped


def _m2po_dist_worker(rank, world, seed):
    from hyperrl.distributed import ParallelDims, make_parallel
    from hyperrl.transforms.correction import m2po_global_mask

    par = make_parallel(ParallelDims.from_env())
    lr, m = _lr_batch(seed, B=8)
    rows = torch.tensor(par.shard(list(range(8))))
    return m2po_global_mask(lr[rows], m[rows], tau=0.04, gather=par.gather_values).numpy()


@pytest.mark.dist
def test_m2po_global_on_two_gloo_ranks_is_the_one_process_mask():
    from hyperrl.transforms.correction import m2po_global_mask
    from tests.dist_helpers import run_gloo

    res = run_gloo(_m2po_dist_worker, 2, 3, timeout=120)
    lr, m = _lr_batch(3, B=8)
    whole = m2po_global_mask(lr, m, tau=0.04)
    assert not bool(whole[m].all())  # some tokens dropped: the case is not vacuous
    for r in range(2):
        assert (torch.from_numpy(res[r]) == whole[r::2]).all()
