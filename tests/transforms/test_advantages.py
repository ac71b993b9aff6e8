import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.transforms import (
    ADVANTAGES,
    compute_advantages,
    dr_grpo_advantages,
    gae,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    grpo_process_advantages,
    normalize_then_sum_advantages,
    opo_advantages,
    register_advantage,
    reinforce_pp_returns,
    remax_advantages,
    rloo_advantages,
)
from hyperrl.transforms.groups import dense_group_index, group_stats
from tests.conftest import random_batch


def loop_grpo(scores, gids, eps=1e-6):
    """Per-sample Python reference (verl-style loop)."""
    out = []
    for i in range(len(scores)):
        grp = [scores[j] for j in range(len(scores)) if gids[j] == gids[i]]
        n = len(grp)
        if n < 2 or max(grp) == min(grp):
            out.append(0.0)
            continue
        mu = sum(grp) / n
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (n - 1))
        out.append((scores[i] - mu) / (sd + eps))
    return torch.tensor(out)


groups_st = st.lists(st.tuples(st.integers(-5, 5), st.floats(-3, 3, width=32)), min_size=1, max_size=40)


def test_grpo_golden():
    # group 7: [1, 0, 1] -> mu = 2/3, var = ((1/3)^2*2 + (2/3)^2)/2 = 1/3, sd = 0.57735
    #   A = (1 - 2/3)/0.57735 = 0.57735, (0 - 2/3)/0.57735 = -1.1547
    # group 3: [1, 0.5] -> mu = 0.75, sd = sqrt(2*0.25^2/1) = 0.35355 -> A = ±0.7071
    # group 9: singleton -> 0 ("zero") or 0.5 ("raw", verl: mu=0, sd=1)
    s = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    g = torch.tensor([7, 7, 7, 3, 3, 9])
    want = torch.tensor([0.57735, -1.1547, 0.57735, 0.70711, -0.70711, 0.0])
    torch.testing.assert_close(grpo_advantages(s, g, eps=0.0), want, atol=1e-4, rtol=0)
    assert grpo_advantages(s, g, singleton="raw")[-1] == 0.5
    with pytest.raises(ValueError, match="group_id: a group has a single sample"):
        grpo_advantages(s, g, singleton="error")
    # rloo: n/(n-1)(s - mu): group 7 -> 1.5*(1/3) = 0.5, 1.5*(-2/3) = -1; group 3 -> 2*0.25 = 0.5
    torch.testing.assert_close(rloo_advantages(s, g), torch.tensor([0.5, -1.0, 0.5, 0.5, -0.5, 0.0]))


@given(groups_st)
def test_grpo_matches_loop_reference(items):
    g = torch.tensor([a for a, _ in items])
    s = torch.tensor([b for _, b in items])
    torch.testing.assert_close(grpo_advantages(s, g), loop_grpo(s.tolist(), g.tolist()), atol=2e-4, rtol=1e-4)


@given(groups_st)
def test_group_zero_mean_and_unit_std(items):
    g = torch.tensor([a for a, _ in items])
    s = torch.tensor([b for _, b in items])
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        a = fn(s, g).double()
        for gid in g.unique():
            sel = g == gid
            assert abs(float(a[sel].sum())) < 1e-3 * max(1, int(sel.sum()))
    a = grpo_advantages(s, g, eps=0.0)
    for gid in g.unique():
        sel = g == gid
        if sel.sum() > 1 and float(s[sel].std()) > 1e-3:
            assert abs(float(a[sel].std(unbiased=True)) - 1.0) < 1e-3


@given(groups_st, st.randoms(use_true_random=False))
def test_equivariance_permute_and_relabel(items, rnd):
    g = torch.tensor([a for a, _ in items])
    s = torch.tensor([b for _, b in items])
    perm = list(range(len(items)))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    labels = {int(x): rnd.randint(-(10**9), 10**9) for x in g.unique()}
    while len(set(labels.values())) < len(labels):
        labels = {int(x): rnd.randint(-(10**9), 10**9) for x in g.unique()}
    g2 = torch.tensor([labels[int(x)] for x in g])
    for name in ("grpo", "dr_grpo", "rloo", "batch_std", "gpg"):
        fn = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages,
              "gpg": gpg_advantages}.get(name)
        if fn is None:
            from hyperrl.transforms import batch_std_advantages as fn
        base = fn(s, g)
        torch.testing.assert_close(fn(s[perm], g[perm]), base[perm], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fn(s, g2), base, atol=1e-5, rtol=1e-5)


def test_near_constant_group_is_stable():
    # one-pass E[x²]−E[x]² would leave residue here; two-pass + exact constancy gives 0
    s = torch.full((16,), 0.1) + torch.tensor([0.0] * 15 + [1e-7])
    g = torch.zeros(16, dtype=torch.long)
    a = grpo_advantages(s, g)
    assert torch.isfinite(a).all()
    assert grpo_advantages(torch.full((8,), 0.1), torch.zeros(8, dtype=torch.long)).abs().max() == 0


def test_dense_group_index():
    g = torch.tensor([40, -3, 40, 7, -3])
    idx = dense_group_index(g)
    assert idx.tolist() == [2, 0, 2, 1, 0]
    st_ = group_stats(torch.tensor([1.0, 2, 3, 4, 4]), g)
    assert st_.count.tolist() == [2, 2, 2, 1, 2]
    assert st_.constant.tolist() == [False, False, False, True, False]


def test_opo_gpg_passk_golden():
    s = torch.tensor([1.0, 0.0, 0.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    L = torch.tensor([3.0, 1.0, 1.0, 1.0])
    # OPO group 0: b = (3*1 + 1*0)/4 = 0.75 -> [0.25, -0.75]; group 1: b = 0.5 -> [-0.5, 0.5]
    torch.testing.assert_close(opo_advantages(s, g, L), torch.tensor([0.25, -0.75, -0.5, 0.5]))
    # GPG: alpha = 4 / 2 nonzero = 2; (s - mu) = ±0.5 -> ±1
    torch.testing.assert_close(gpg_advantages(s, g), torch.tensor([1.0, -1.0, -1.0, 1.0]))
    # pass@k: group [0.2, 0.9, 0.5]: best index 1 gets 0.9-0.5 = 0.4 (no std), others 0
    p = grpo_passk_advantages(torch.tensor([0.2, 0.9, 0.5]), torch.zeros(3, dtype=torch.long), norm_by_std=False)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.4, 0.0]))
    with pytest.raises(ValueError, match="at least 2"):
        grpo_passk_advantages(s, torch.tensor([0, 0, 1, 2]))


def test_normalize_then_sum_zero_mean_unit_std():
    g = torch.arange(12) // 4
    comps = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    a = normalize_then_sum_advantages(comps, g, torch.tensor([1.0, 0.5, 2.0]))
    assert abs(float(a.mean())) < 1e-5 and abs(float(a.std()) - 1) < 1e-4
    with pytest.raises(ValueError, match="components"):
        normalize_then_sum_advantages(comps[:, 0], g)


def loop_gae(r, v, m, gamma, lam):
    """Reference: recursion over the action positions only (the 'skip' semantics)."""
    B, T = r.shape
    out = torch.zeros(B, T)
    for b in range(B):
        idx = [t for t in range(T) if m[b, t]]
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            a = r[b, t] + gamma * v_next - v[b, t] + gamma * lam * a_next
            out[b, t] = a
            a_next, v_next = a, v[b, t]
    return out


def test_gae_golden():
    # one sequence, 3 actions, gamma=1, lam=1, rewards [0, 0, 1], values [0.5, 0.5, 0.5]
    # A_2 = 1 - 0.5 = 0.5; A_1 = 0 + 0.5 - 0.5 + 0.5 = 0.5; A_0 = 0.5 (= G - V)
    r = torch.tensor([[0.0, 0, 0, 1]])
    v = torch.tensor([[9.0, 0.5, 0.5, 0.5]])
    m = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0]]))


@given(st.integers(0, 1000), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_skip_matches_loop_and_modes_agree_without_holes(seed, gamma, lam):
    b = random_batch(B=5, T=10, seed=seed, holes=True)
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(5, 10, generator=gen)
    v = torch.randn(5, 10, generator=gen)
    m = b["action_mask"]
    adv, _ = gae(r, v, m, gamma=gamma, lam=lam, masked="skip")
    torch.testing.assert_close(adv, loop_gae(r, v, m, gamma, lam), atol=1e-5, rtol=1e-5)
    # masked positions never affect results
    r2 = torch.where(m, r, torch.randn(5, 10, generator=gen) * 100)
    v2 = torch.where(m, v, torch.randn(5, 10, generator=gen) * 100)
    torch.testing.assert_close(gae(r2, v2, m, gamma=gamma, lam=lam)[0], adv)
    nb = random_batch(B=5, T=10, seed=seed, holes=False)
    m = nb["action_mask"]
    a1, _ = gae(r, v, m, gamma=gamma, lam=lam, masked="skip")
    a2, _ = gae(r, v, m, gamma=gamma, lam=lam, masked="zero")
    torch.testing.assert_close(a1, a2, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_and_remax():
    m = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.bool)
    r = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]])
    _, G = reinforce_pp_returns(r, m, gamma=0.5, masked="skip")
    # skip: G_4 = 2, G_2 = 0 + 0.5*2 = 1 (position 3 is carried), G_1 = 1 + 0.5*1 = 1.5
    torch.testing.assert_close(G, torch.tensor([[0.0, 1.5, 1.0, 0.0, 2.0]]))
    _, G = reinforce_pp_returns(r, m, gamma=0.5, masked="discount")
    # discount: G_3 = 0 + 0.5*2 = 1 (hidden), G_2 = 0.5, G_1 = 1 + 0.25 = 1.25
    torch.testing.assert_close(G, torch.tensor([[0.0, 1.25, 0.5, 0.0, 2.0]]))
    adv, _ = remax_advantages(r, m, torch.tensor([1.0]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.0, 1.0, 0.0, 1.0]]))


def test_adapter_returns_new_batch_and_broadcasts():
    b = random_batch(B=8, T=12, seed=3)
    before = {k: v.clone() for k, v in b.items()}
    out = compute_advantages(b, "grpo")
    assert "advantages" not in b.keys()
    for k, v in before.items():
        assert torch.equal(b[k], v)
    a = out["advantages"]
    assert torch.equal(a != 0, (a != 0) & b["action_mask"])
    seq = grpo_advantages(b["reward"], b["group_id"])
    torch.testing.assert_close(a[b["action_mask"]], seq[:, None].expand(8, 12)[b["action_mask"]])


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_every_estimator_runs_through_adapter(name):
    b = random_batch(B=8, T=12, seed=5)
    b["values"] = torch.randn(8, 12)
    b["baseline_reward"] = torch.rand(8)
    b["reward_components"] = torch.rand(8, 2)
    b["token_rewards"] = torch.where(b["action_mask"], torch.rand(8, 12), 0.0)
    b["old_logprobs"] = torch.where(b["action_mask"], -torch.rand(8, 12), 0.0)
    b["sum_pi_squared"] = torch.rand(8, 12)
    if name == "grpo_passk":
        b["reward"] = torch.arange(8).float()
    out = compute_advantages(b, name)
    a = out["advantages"]
    assert a.shape == (8, 12) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert (a[~b["action_mask"]] == 0).all()


def test_missing_inputs_named():
    b = random_batch()
    with pytest.raises(KeyError, match="values: gae needs critic values"):
        compute_advantages(b, "gae")
    with pytest.raises(KeyError, match="unknown advantage estimator 'gpro'"):
        compute_advantages(b, "gpro")


def test_register_custom_estimator():
    @register_advantage("test_constant_one")
    def _one(batch):
        return {"advantages": batch["action_mask"].float()}

    out = compute_advantages(random_batch(), "test_constant_one")
    assert out["advantages"].sum() == random_batch()["action_mask"].sum()
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("test_constant_one")(_one)


def test_verl_singleton_semantics_for_opo_gpg_and_rpp_baseline():
    # scores [1, 0 | 3]: group 0 = rows 0, 1; group 1 = row 2 alone. verl gives a singleton group mean 0.
    from hyperrl.transforms import gpg_advantages, opo_advantages, reinforce_pp_baseline_advantages

    s, g = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 1])
    # OPO, lengths [1, 1, 2]: b_0 = (1·1 + 1·0)/2 = 0.5 → ±0.5; singleton: baseline 0 → 3 (raw) or 0 (zero)
    assert opo_advantages(s, g, torch.tensor([1, 1, 2]), singleton="raw").tolist() == [0.5, -0.5, 3.0]
    assert opo_advantages(s, g, torch.tensor([1, 1, 2])).tolist() == [0.5, -0.5, 0.0]
    # GPG: α = B / #nonzero = 3/2; group 0: 1.5·(±0.5) = ±0.75; singleton raw: 1.5·3 = 4.5
    assert gpg_advantages(s, g, singleton="raw").tolist() == [0.75, -0.75, 4.5]
    assert gpg_advantages(s, g).tolist() == [0.75, -0.75, 0.0]
    # REINFORCE++-baseline raw: centred [0.5, −0.5, 3], whitened: μ = 1, σ² = (0.25 + 2.25 + 4)/2 = 3.25
    m = torch.ones(3, 1, dtype=torch.bool)
    want = torch.tensor([-0.5, -1.5, 2.0]) / 3.25 ** 0.5
    assert torch.allclose(reinforce_pp_baseline_advantages(s, g, m, singleton="raw")[:, 0], want, atol=1e-6)
    with pytest.raises(ValueError, match="single sample"):
        gpg_advantages(s, g, singleton="error")


def test_gae_adapter_whitens_by_default_like_verl():
    from hyperrl.transforms import gae, masked_whiten, scores_to_token_rewards

    b = _traj_for_gae()
    out = compute_advantages(b, "gae")
    adv, _ = gae(scores_to_token_rewards(b["reward"], b["action_mask"]), b["values"], b["action_mask"])
    assert torch.allclose(out["advantages"], masked_whiten(adv, b["action_mask"]))


def _traj_for_gae():
    from hyperrl.trajectory import make_trajectory

    B, T_ = 4, 5
    attn = torch.ones(B, T_, dtype=torch.bool)
    act = attn & (torch.arange(T_) >= 2)
    return make_trajectory(tokens=torch.zeros(B, T_, dtype=torch.long), attention_mask=attn, action_mask=act,
                           rollout_logprobs=torch.zeros(B, T_), policy_version=torch.zeros(B, dtype=torch.long),
                           group_id=torch.arange(B), reward=torch.tensor([1.0, 0.0, 0.5, 2.0]),
                           values=torch.linspace(0, 1, B * T_).reshape(B, T_))


def test_grpo_process_golden():
    # one group of two rows, steps on every action token (the last 3 positions):
    # row 0 step rewards [1, 1, 0], row 1 [1, 0, 0] → pooled μ = 3/6 = 0.5, σ² = 6·0.25/5 = 0.3;
    # r̃ = (r − 0.5)/√0.3 = ±0.9129; A_t = Σ_{j ≥ t} r̃_j:
    # row 0: [k + k − k, k − k, −k] = [k, 0, −k]; row 1: [k − k − k, −2k, −k] with k = 0.9129
    m = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    r = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)
    a = grpo_process_advantages(r, m, torch.tensor([0, 0]), m, eps=0.0)
    k = 0.5 / math.sqrt(0.3)
    torch.testing.assert_close(a, torch.tensor([[0, k, 0, -k], [0, -k, -2 * k, -k]]))


@given(st.integers(0, 10_000), st.integers(1, 4))
def test_grpo_process_with_one_outcome_step_per_row_is_grpo(seed, group_size):
    # a single step per row, on its last action token: the pooled step statistics are the group's
    # outcome statistics and every token's reward-to-go is that one step → GRPO broadcast
    b = random_batch(B=8, T=12, group_size=group_size, seed=seed)
    m = b["action_mask"]
    last = torch.where(m, torch.arange(12), -1).amax(-1)
    steps = torch.zeros_like(m)
    steps[torch.arange(8), last] = True
    r = torch.where(steps, b["reward"][:, None], 0.0)
    got = grpo_process_advantages(r, steps, b["group_id"], m)
    want = grpo_advantages(b["reward"], b["group_id"])
    torch.testing.assert_close(got, torch.where(m, want[:, None], 0.0))


def test_grpo_process_constant_group_is_zero_and_bad_steps_are_named():
    b = random_batch(B=4, T=8, group_size=4, seed=1)
    m = b["action_mask"]
    assert (grpo_process_advantages(torch.where(m, 0.5, 0.0), m, b["group_id"], m) == 0).all()
    prompt = ~m & b["attention_mask"]
    with pytest.raises(ValueError, match="step_mask: a step reward off the action tokens"):
        grpo_process_advantages(torch.zeros(4, 8), m | prompt, b["group_id"], m)
    with pytest.raises(KeyError, match="token_rewards: grpo_process needs"):
        compute_advantages(b, "grpo_process")


def test_compute_advantages_names_a_missing_or_misshaped_input():
    import pytest
    import torch
    from tensordict import TensorDict

    import hyperrl.transforms as T

    B = 5
    base = {"group_id": torch.zeros(B, dtype=torch.long), "action_mask": torch.ones(B, 3, dtype=torch.bool)}
    col = TensorDict({**base, "reward": torch.rand(B, 1)}, batch_size=[B])
    with pytest.raises(ValueError, match=r"batch key 'reward' has shape \[5, 1\]; expected \[B\] .* reward\[:, 0\]"):
        T.compute_advantages(col, "grpo")
    flat = TensorDict({"reward": torch.rand(B), "action_mask": base["action_mask"]}, batch_size=[B])
    with pytest.raises(KeyError, match=r"batch key 'group_id' is missing — \[B\] int64, the prompt group"):
        T.compute_advantages(flat, "rloo")
    with pytest.raises(ValueError, match="advantage 'grpo'.clip: .* takes no argument 'clip'"):
        T.compute_advantages(col.set("reward", torch.rand(B)), "grpo", clip=0.2)
