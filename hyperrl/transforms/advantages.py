"""Advantage estimators: pure kernels, one registry, and the ``compute_advantages`` adapter.

Outcome estimators map sequence scores ``s`` ``[B]`` and group ids ``[B]`` to advantages ``[B]``;
token estimators map per-token rewards ``[B, T]`` (and values) to advantages/returns ``[B, T]``.
Group statistics are segment sums over arbitrary integer ids (:mod:`hyperrl.transforms.groups`).

Explicit degenerate-group behaviour (the same in every estimator that normalises by group):
* zero-variance groups (all scores exactly equal) get advantage exactly ``0``;
* singleton groups follow ``singleton``: ``"zero"`` (default, no baseline → no signal),
  ``"raw"`` (verl's ``grpo``: μ = 0, σ = 1, so ``A = s``) or ``"error"`` (OpenRLHF /
  HyperParallel-RL refuse groups of one).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hyperrl.registry import Fraction, NonNegative, Positive, Registry
from hyperrl.transforms.groups import dense_group_index, group_stats, segment_sum

__all__ = [
    "ADVANTAGES",
    "register_advantage",
    "compute_advantages",
    "grpo_advantages",
    "dr_grpo_advantages",
    "batch_std_advantages",
    "rloo_advantages",
    "opo_advantages",
    "gpg_advantages",
    "grpo_passk_advantages",
    "normalize_then_sum_advantages",
    "gae",
    "reinforce_pp_returns",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "optimal_token_baseline_advantages",
    "grpo_process_advantages",
    "discounted_returns",
    "masked_whiten",
    "scores_to_token_rewards",
]

_SINGLETON = ("zero", "raw", "error")


def _singletons(adv: torch.Tensor, scores: torch.Tensor, count: torch.Tensor, singleton: str) -> torch.Tensor:
    if singleton not in _SINGLETON:
        raise ValueError(f"singleton={singleton!r}; choose one of {_SINGLETON}")
    if singleton == "error":
        if bool((count < 2).any()):
            raise ValueError("group_id: a group has a single sample; group-relative advantages need n ≥ 2")
        return adv
    fill = scores.to(adv.dtype) if singleton == "raw" else torch.zeros_like(adv)
    return torch.where(count < 2, fill, adv)


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, singleton: str = "zero"
) -> torch.Tensor:
    """GRPO: ``A_i = (s_i − μ_g) / (σ_g + eps)``, σ unbiased. ``[B] → [B]`` fp32.

    Shao et al. 2024 (DeepSeekMath). eps: verl 1e-6, TRL 1e-4, OpenRLHF 1e-9.
    """
    g = group_stats(scores, group_ids)
    adv = (scores.float() - g.mean) / (g.std + eps)
    adv = torch.where(g.constant, torch.zeros_like(adv), adv)
    return _singletons(adv, scores, g.count, singleton)


def dr_grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, *, singleton: str = "zero") -> torch.Tensor:
    """Dr. GRPO: ``A_i = s_i − μ_g`` (no std division). Liu et al. 2025. ``[B] → [B]``."""
    g = group_stats(scores, group_ids)
    adv = torch.where(g.constant, torch.zeros_like(g.mean), scores.float() - g.mean)
    return _singletons(adv, scores, g.count, singleton)


def batch_std_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, singleton: str = "zero"
) -> torch.Tensor:
    """Lite PPO / TRL ``scale_rewards="batch"``: ``A_i = (s_i − μ_g) / (σ_batch + eps)`` (σ unbiased)."""
    s = scores.float()
    g = group_stats(s, group_ids)
    sd = ((s - s.mean()) ** 2).sum().div(max(s.numel() - 1, 1)).sqrt()
    adv = torch.where(g.constant, torch.zeros_like(s), (s - g.mean) / (sd + eps))
    return _singletons(adv, scores, g.count, singleton)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, *, singleton: str = "zero") -> torch.Tensor:
    """RLOO: ``A_i = s_i − mean_{j≠i} s_j = n/(n−1)·(s_i − μ_g)``. Ahmadian et al. 2024.

    Singletons: ``"zero"`` = verl ``rloo_vectorized``; ``"raw"`` = verl ``rloo`` (keeps ``s_i``).
    """
    g = group_stats(scores, group_ids)
    n = g.count.float()
    adv = n / (n - 1).clamp_min(1) * (scores.float() - g.mean)
    adv = torch.where(g.constant, torch.zeros_like(adv), adv)
    return _singletons(adv, scores, g.count, singleton)


def _centred(scores: torch.Tensor, baseline: torch.Tensor, g, singleton: str) -> torch.Tensor:
    """``s − b`` with zero-variance groups at exactly 0 and singletons per ``singleton``:
    ``"zero"`` → 0, ``"raw"`` → the baseline is 0 (verl: ``A = s``), ``"error"`` → raise."""
    s = scores.float()
    out = torch.where(g.constant, torch.zeros_like(s), s - baseline)
    return _singletons(out, scores, g.count, singleton)


def opo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, *,
                   singleton: str = "zero") -> torch.Tensor:
    """OPO: length-weighted baseline ``b_g = Σ_j L_j s_j / Σ_j L_j``; ``A_i = s_i − b_g``. ``[B]``.

    Singletons: ``"zero"`` (no baseline → no signal) or ``"raw"`` (verl: baseline 0, ``A = s``).
    """
    s, w = scores.float(), lengths.float()
    g = group_stats(s, group_ids)
    B = s.shape[0]
    num = segment_sum(w * s, g.index, B)
    den = segment_sum(w, g.index, B).clamp_min(1e-12)
    return _centred(s, (num / den)[g.index], g, singleton)


def gpg_advantages(scores: torch.Tensor, group_ids: torch.Tensor, *, f_norm: float = 1.0,
                   singleton: str = "zero") -> torch.Tensor:
    """GPG: ``A_i = α·(s_i − μ_g)/f_norm``, ``α = B / max(1, #{i: s_i ≠ 0})``. Chu et al. 2025.

    Singletons: ``"zero"`` or ``"raw"`` (verl: μ = 0, ``A = α·s/f_norm``).
    """
    s = scores.float()
    g = group_stats(s, group_ids)
    alpha = s.shape[0] / (s != 0).sum().clamp_min(1).float()
    return alpha * _centred(s, g.mean, g, singleton) / f_norm


def grpo_passk_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """Pass@k GRPO: only each group's best sample (lowest index on ties) gets ``r_max − r_2nd``
    (divided by ``σ_g + eps`` when ``norm_by_std``); all others 0. Raises on groups of < 2."""
    s = scores.float()
    g = group_stats(s, group_ids)
    if bool((g.count < 2).any()):
        raise ValueError("group_id: grpo_passk needs groups of at least 2 samples")
    B = s.shape[0]
    idx = torch.arange(B, device=s.device)
    top = torch.full((B,), float("-inf")).scatter_reduce(0, g.index, s, "amax")[g.index]
    cand = torch.where(s == top, idx, torch.full_like(idx, B))
    best = torch.full((B,), B, dtype=idx.dtype).scatter_reduce(0, g.index, cand, "amin")[g.index]
    is_best = idx == best
    rest = torch.where(is_best, torch.full_like(s, float("-inf")), s)
    second = torch.full((B,), float("-inf")).scatter_reduce(0, g.index, rest, "amax")[g.index]
    gap = top - second
    if norm_by_std:
        gap = gap / (g.std + eps)
    return torch.where(is_best & ~g.constant, gap, torch.zeros_like(s))


def normalize_then_sum_advantages(
    components: torch.Tensor, group_ids: torch.Tensor, weights: torch.Tensor | None = None, *, eps: float = 1e-6
) -> torch.Tensor:
    """GDPO / TRL ``multi_objective_aggregation="normalize_then_sum"``.

    Group z-score each reward component ``[B, K]``, weighted sum over K, then batch z-score.
    """
    if components.dim() != 2:
        raise ValueError(f"components: expected [B, K], got {list(components.shape)}")
    K = components.shape[1]
    w = torch.ones(K) if weights is None else weights.float()
    z = torch.stack([grpo_advantages(components[:, k], group_ids, eps=eps) for k in range(K)], -1)
    total = (z * w).sum(-1)
    sd = ((total - total.mean()) ** 2).sum().div(max(total.numel() - 1, 1)).sqrt()
    return (total - total.mean()) / (sd + eps)


# ----------------------------------------------------------------------------- token-level


def scores_to_token_rewards(scores: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's outcome score on its last action token. ``[B], [B, T] → [B, T]``."""
    m = action_mask.bool()
    T = m.shape[-1]
    last = torch.where(m, torch.arange(T, device=m.device), -1).amax(-1)
    out = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    has = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    return out.index_put((rows, last[has]), scores.float()[has])


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True, eps: float = 1e-8, shift_mean: bool = True
) -> torch.Tensor:
    """``(x − μ)/(σ + eps)`` over valid positions (two-pass); invalid positions return 0.

    ``unbiased=False`` is OpenRLHF's biased variance; verl uses the unbiased one.
    """
    m = mask.bool()
    n = m.sum().clamp_min(1)
    mu = torch.where(m, x, 0).sum() / n
    var = (torch.where(m, x - mu, 0) ** 2).sum() / (n - 1 if unbiased else n).clamp_min(1)
    y = (x - mu) / (var.sqrt() + eps)
    if not shift_mean:
        y = y + mu
    return torch.where(m, y, torch.zeros_like(y))


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, masked: str = "skip"
) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + γ G_{t+1}`` ``[B, T]``; zero off the mask.

    ``masked="skip"``: masked (observation) tokens neither discount nor add reward — the running
    return is carried through them (verl). ``"discount"``: they count as zero-reward steps.
    """
    if masked not in ("skip", "discount"):
        raise ValueError(f"masked={masked!r}; choose 'skip' or 'discount'")
    m = mask.bool()
    r = torch.where(m, token_rewards.float(), 0)
    if gamma == 1.0:  # undiscounted: a reversed cumulative sum, right to left as the loop adds (no masked carry)
        return torch.where(m, r.flip(-1).cumsum(-1).flip(-1), 0)
    G = torch.zeros_like(r[:, 0])
    out = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        new = r[:, t] + gamma * G
        G = torch.where(m[:, t], new, G) if masked == "skip" else new
        out[:, t] = G
    return torch.where(m, out, 0)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    masked: str = "skip",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016). ``[B, T]`` → (advantages, returns).

    ``δ_t = r_t + γ V_{t+1} − V_t``, ``A_t = δ_t + γλ A_{t+1}``, ``returns = A + V``; after the
    last action the next value is 0 (terminal). ``masked="skip"`` (verl, HyperParallel-RL):
    ``t+1`` means the next *action* position, V and A are carried through masked tokens.
    ``masked="zero"`` (OpenRLHF): rewards and values are zeroed off the mask and the recursion
    runs over every position. Both agree when the mask has no interior holes.
    """
    if masked not in ("skip", "zero"):
        raise ValueError(f"masked={masked!r}; choose 'skip' or 'zero'")
    m = mask.bool()
    r = torch.where(m, token_rewards.float(), 0)
    v = torch.where(m, values.float(), 0)
    A_next = torch.zeros_like(r[:, 0])
    V_next = torch.zeros_like(A_next)
    adv = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        a_t = r[:, t] + gamma * V_next - v[:, t] + gamma * lam * A_next
        if masked == "skip":
            A_next = torch.where(m[:, t], a_t, A_next)
            V_next = torch.where(m[:, t], v[:, t], V_next)
        else:
            A_next, V_next = a_t, v[:, t]
        adv[:, t] = A_next
    adv = torch.where(m, adv, 0)
    return adv, torch.where(m, adv + v, 0)


def reinforce_pp_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, masked: str = "skip", unbiased=True
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, then whitened over all valid tokens.

    Returns (advantages, returns) ``[B, T]``. ``unbiased=False`` is OpenRLHF's whitening.
    """
    G = discounted_returns(token_rewards, mask, gamma=gamma, masked=masked)
    return masked_whiten(G, mask, unbiased=unbiased), G


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True,
    singleton: str = "zero",
) -> torch.Tensor:
    """REINFORCE++-baseline: ``s_i − μ_g`` broadcast to action tokens, then batch whitening.

    Singletons: ``"zero"`` or ``"raw"`` (verl: μ = 0, which shifts the batch whitening).
    """
    g = group_stats(scores, group_ids)
    centred = _centred(scores, g.mean, g, singleton)
    return masked_whiten(centred[:, None].expand(mask.shape), mask, unbiased=unbiased)


def remax_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): ``A_t = G_t − b_i`` with ``G`` the undiscounted reward-to-go and
    ``b_i`` the reward of a greedy rollout of the same prompt ``[B]``. Returns (advantages, returns)."""
    G = discounted_returns(token_rewards, mask, gamma=1.0)
    return torch.where(mask.bool(), G - baseline.float()[:, None], 0), G


def optimal_token_baseline_advantages(
    token_rewards: torch.Tensor, old_logprobs: torch.Tensor, sum_pi_squared: torch.Tensor, mask: torch.Tensor,
    group_ids: torch.Tensor, *, handle_zero_tail: bool = True, eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (verl 0.9 ``adv_estimator=optimal_token_baseline``): a baseline per
    group and per response position ``t`` weighted by the path's cumulative score variance,

        ``w_t = 1 − 2·π_t + Σ_v π_v²``  (π_t = exp(old_logprobs), Σπ² of the old policy at t),
        ``W_t = Σ_{j ≤ t} m_j·w_j``,    ``B_t = Σ_i G_{i,t}·W_{i,t}·m_{i,t} / (Σ_i W_{i,t}·m_{i,t} + eps)``,
        ``A_{i,t} = (G_{i,t} − B_t)·m_{i,t}``,

    ``G`` the undiscounted reward-to-go ``[B, T]``. A group of one has no baseline (A = G);
    ``handle_zero_tail``: the baseline of a group's single longest row is 0 past its second-longest
    row's length (verl's default). Positions are response positions — every row of a group must start
    its response at one column (a group's rows share its prompt). Returns (advantages, returns)."""
    m = mask.bool()
    if not (token_rewards.shape == old_logprobs.shape == sum_pi_squared.shape == m.shape):
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)}, old_logprobs {tuple(old_logprobs.shape)}, "
                         f"sum_pi_squared {tuple(sum_pi_squared.shape)} and mask {tuple(m.shape)} must share [B, T]")
    mf = m.to(torch.float32)
    G = discounted_returns(token_rewards, mask, gamma=1.0)
    Wm = old_logprobs.float().exp().mul_(-2).add_(1).add_(sum_pi_squared.float()).mul_(mf).cumsum_(-1).mul_(mf)
    uniq, inv, count = torch.unique(group_ids, return_inverse=True, return_counts=True)
    has = m.any(-1)
    first = torch.where(has, m.int().argmax(-1), -1)
    starts = torch.full((len(uniq),), -1, dtype=torch.long, device=m.device).scatter_reduce(0, inv, first, "amax")
    off = has & (first != starts[inv])
    if bool(off.any()):
        raise ValueError(f"group_id {int(group_ids[off][0])}: its rows start their responses at different columns; the "
                         "optimal token baseline aligns a group's rows by response position (rows of one prompt)")
    Tn = m.shape[1]
    num = torch.zeros(len(uniq), Tn, device=m.device).index_add_(0, inv, G * Wm)
    den = torch.zeros(len(uniq), Tn, device=m.device).index_add_(0, inv, Wm).add_(eps)
    base = num.div_(den)[inv]
    base[count[inv] < 2] = 0.0  # a group of one: no baseline
    if handle_zero_tail:
        lengths = m.sum(-1)
        top2 = torch.full((len(uniq),), -1, dtype=lengths.dtype, device=m.device).scatter_reduce(0, inv, lengths,
                                                                                                 "amax")
        longest = lengths == top2[inv]
        n_longest = torch.zeros(len(uniq), dtype=torch.long, device=m.device).index_add_(0, inv, longest.long())
        second = torch.full_like(top2, -1).scatter_reduce(0, inv, torch.where(longest, -1, lengths), "amax")
        lone = longest & (n_longest[inv] == 1) & (count[inv] > 1) & (second[inv] >= 0)
        for row in torch.nonzero(lone).flatten().tolist():  # at most one row per group
            base[row, int(starts[inv[row]]) + int(second[inv[row]]):] = 0.0
    return torch.where(m, G - base, 0.0), G


def grpo_process_advantages(
    token_rewards: torch.Tensor, step_mask: torch.Tensor, group_ids: torch.Tensor, action_mask: torch.Tensor, *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO with process supervision (Shao et al. 2024, DeepSeekMath §4.1.3): every step reward
    ``r_{i,j}`` (at the positions ``step_mask`` ``[B, T]`` marks) is normalised by the mean and
    (unbiased) std of all step rewards of its group, ``r̃ = (r − μ_g)/(σ_g + eps)``, and a token's
    advantage is the sum of the normalised rewards of the steps at or after it in its row,
    ``A_{i,t} = Σ_{j ≥ t} r̃_{i,j}`` ``[B, T]`` (0 off ``action_mask``). A group whose step rewards
    are all equal gets 0. Steps must lie on action tokens."""
    m, st = action_mask.bool(), step_mask.bool()
    if st.shape != m.shape or token_rewards.shape != m.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)}, step_mask {tuple(st.shape)} and action_mask "
                         f"{tuple(m.shape)} must have one shape [B, T]")
    if bool((st & ~m).any()):
        raise ValueError("step_mask: a step reward off the action tokens (prompt or observation); steps must be "
                         "tokens the policy sampled")
    r = torch.where(st, token_rewards.float(), 0)
    B = r.shape[0]
    idx = dense_group_index(group_ids)
    n = segment_sum(st.float().sum(-1), idx, B)
    mean = segment_sum(r.sum(-1), idx, B) / n.clamp_min(1)
    dev = torch.where(st, r - mean.index_select(0, idx)[:, None], 0)
    std = (segment_sum((dev * dev).sum(-1), idx, B) / (n - 1).clamp_min(1)).sqrt()
    lo = torch.where(st, r, float("inf")).amin(-1)
    hi = torch.where(st, r, float("-inf")).amax(-1)
    const = (torch.full((B,), float("inf")).scatter_reduce(0, idx, lo, "amin") ==
             torch.full((B,), float("-inf")).scatter_reduce(0, idx, hi, "amax")) | (n <= 1)
    norm = torch.where(const.index_select(0, idx)[:, None], 0, dev / (std.index_select(0, idx)[:, None] + eps))
    return discounted_returns(norm, m, gamma=1.0)


# ----------------------------------------------------------------------------- registry + adapter

ADVANTAGES: Registry = Registry("advantage estimator")
register_advantage = ADVANTAGES.register


def _broadcast(adv: torch.Tensor, batch: TensorDict) -> dict:
    m = batch["action_mask"]
    return {"advantages": torch.where(m, adv.float()[:, None], 0)}


def _token_rewards(batch: TensorDict) -> torch.Tensor:
    if "token_rewards" in batch.keys():
        return batch["token_rewards"]
    return scores_to_token_rewards(batch["reward"], batch["action_mask"])


@register_advantage("grpo", needs=("reward", "group_id"), produces=("advantages",))
def _grpo(batch, *, eps: NonNegative = 1e-6, singleton="zero"):
    return _broadcast(grpo_advantages(batch["reward"], batch["group_id"], eps=eps, singleton=singleton), batch)


@register_advantage("dr_grpo", needs=("reward", "group_id"), produces=("advantages",))
def _dr_grpo(batch, *, singleton="zero"):
    return _broadcast(dr_grpo_advantages(batch["reward"], batch["group_id"], singleton=singleton), batch)


@register_advantage("batch_std", needs=("reward", "group_id"), produces=("advantages",))
def _batch_std(batch, *, eps: NonNegative = 1e-6, singleton="zero"):
    return _broadcast(batch_std_advantages(batch["reward"], batch["group_id"], eps=eps, singleton=singleton), batch)


@register_advantage("rloo", needs=("reward", "group_id"), produces=("advantages",))
def _rloo(batch, *, singleton="zero"):
    return _broadcast(rloo_advantages(batch["reward"], batch["group_id"], singleton=singleton), batch)


@register_advantage("opo", needs=("reward", "group_id"), produces=("advantages",))
def _opo(batch, *, singleton="zero"):
    lengths = batch["action_mask"].sum(-1)
    return _broadcast(opo_advantages(batch["reward"], batch["group_id"], lengths, singleton=singleton), batch)


@register_advantage("gpg", needs=("reward", "group_id"), produces=("advantages",))
def _gpg(batch, *, f_norm: Positive = 1.0, singleton="zero"):
    return _broadcast(gpg_advantages(batch["reward"], batch["group_id"], f_norm=f_norm, singleton=singleton), batch)


@register_advantage("grpo_passk", needs=("reward", "group_id"), produces=("advantages",))
def _passk(batch, *, eps: NonNegative = 1e-6, norm_by_std=True):
    adv = grpo_passk_advantages(batch["reward"], batch["group_id"], eps=eps, norm_by_std=norm_by_std)
    return _broadcast(adv, batch)


@register_advantage("normalize_then_sum", needs=("reward_components", "group_id"), produces=("advantages",))
def _nts(batch, *, components_key="reward_components", weights=None, eps: NonNegative = 1e-6):
    if components_key not in batch.keys():
        raise KeyError(f"{components_key}: normalize_then_sum needs per-component rewards [B, K] under this key")
    w = None if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    return _broadcast(normalize_then_sum_advantages(batch[components_key], batch["group_id"], w, eps=eps), batch)


@register_advantage("gae", needs=("reward", "values"), produces=("advantages", "returns"))
def _gae(batch, *, gamma: Fraction = 1.0, lam: Fraction = 1.0, masked="skip", whiten=True):
    if "values" not in batch.keys():
        raise KeyError("values: gae needs critic values [B, T] in the batch (run the critic first)")
    adv, ret = gae(_token_rewards(batch), batch["values"], batch["action_mask"], gamma=gamma, lam=lam, masked=masked)
    if whiten:
        adv = masked_whiten(adv, batch["action_mask"])
    return {"advantages": adv, "returns": ret}


@register_advantage("reinforce_pp", needs=("reward",), produces=("advantages", "returns"))
def _rpp(batch, *, gamma=1.0, masked="skip", unbiased=True):
    adv, ret = reinforce_pp_returns(_token_rewards(batch), batch["action_mask"], gamma=gamma, masked=masked,
                                    unbiased=unbiased)
    return {"advantages": adv, "returns": ret}


@register_advantage("reinforce_pp_baseline", needs=("reward", "group_id"), produces=("advantages",))
def _rppb(batch, *, unbiased=True, singleton="zero"):
    adv = reinforce_pp_baseline_advantages(batch["reward"], batch["group_id"], batch["action_mask"], unbiased=unbiased,
                                           singleton=singleton)
    return {"advantages": adv}


@register_advantage("remax", needs=("reward", "baseline_reward"), produces=("advantages", "returns"))
def _remax(batch, *, baseline_key="baseline_reward"):
    if baseline_key not in batch.keys():
        raise KeyError(f"{baseline_key}: remax needs the greedy rollout's reward [B] under this key")
    adv, ret = remax_advantages(_token_rewards(batch), batch["action_mask"], batch[baseline_key])
    return {"advantages": adv, "returns": ret}


@register_advantage("optimal_token_baseline", needs=("reward", "group_id", "old_logprobs", "sum_pi_squared"),
                    produces=("advantages", "returns"))
def _otb(batch, *, handle_zero_tail: bool = True, eps: Positive = 1e-8):
    adv, ret = optimal_token_baseline_advantages(_token_rewards(batch), batch["old_logprobs"], batch["sum_pi_squared"],
                                                 batch["action_mask"], batch["group_id"],
                                                 handle_zero_tail=handle_zero_tail, eps=eps)
    return {"advantages": adv, "returns": ret}


@register_advantage("grpo_process", needs=("token_rewards", "group_id"), produces=("advantages",))
def _grpo_process(batch, *, eps: NonNegative = 1e-6, step_key="step_mask"):
    if "token_rewards" not in batch.keys():
        raise KeyError("token_rewards: grpo_process needs per-token step rewards [B, T] (a task with token credit, "
                       "e.g. arith's digit_credit, fills them)")
    steps = batch[step_key] if step_key in batch.keys() else batch["action_mask"]
    return {"advantages": grpo_process_advantages(batch["token_rewards"], steps, batch["group_id"],
                                                  batch["action_mask"], eps=eps)}


# what an estimator's inputs are, for the error a caller sees when one is missing or mis-shaped
_INPUTS = {"reward": (1, "[B] float, one scalar reward per row"),
           "group_id": (1, "[B] int64, the prompt group of each row (a prompt's samples share it)"),
           "baseline_reward": (1, "[B] float, the greedy rollout's reward of each row's group"),
           "reward_components": (2, "[B, K] float, one column per reward"),
           "token_rewards": (2, "[B, T] float, per-token step rewards"),
           "values": (2, "[B, T] float, the critic's values"),
           "old_logprobs": (2, "[B, T] float, the behaviour policy's log-probs"),
           "sum_pi_squared": (2, "[B, T] float, Σ_v π_v² of the old policy at each token (Forwards.sum_pi_squared)")}


def _check_inputs(batch: TensorDict, needs, where: str) -> None:
    """Every key ``needs`` names (and ``action_mask``) present with its rank: an error names the key
    and the expected shape (a ``[B, 1]`` reward is not broadcast silently)."""
    B = batch.batch_size[0] if batch.batch_size else None
    for key in ("action_mask", *needs):
        dim, what = _INPUTS.get(key, (2, "[B, T]") if key == "action_mask" else (None, ""))
        if key not in batch.keys():
            if key in ("values", "token_rewards", "baseline_reward", "reward_components"):
                continue  # the estimator's own message says where these come from
            raise KeyError(f"{where}: batch key {key!r} is missing — {what or 'needed by this estimator'}")
        shape = tuple(batch[key].shape)
        if dim is not None and (len(shape) != dim or shape[0] != B):
            raise ValueError(f"{where}: batch key {key!r} has shape {list(shape)}; expected {what} with B = {B}"
                             + (" (squeeze the trailing 1: reward[:, 0])" if len(shape) == 2 and shape[1:] == (1,)
                                and dim == 1 else ""))


def compute_advantages(batch: TensorDict, estimator="grpo", **kwargs) -> TensorDict:
    """Return a *new* batch with ``advantages`` (and ``returns`` where defined) ``[B, T]``.

    ``estimator`` is a registered name (``ADVANTAGES.names()``) or a callable
    ``(batch, **kwargs) -> dict``. The input batch is not modified.
    """
    if isinstance(estimator, str):
        f = ADVANTAGES.factory(estimator)
        kwargs = f.check(kwargs, f"advantage {estimator!r}")
        _check_inputs(batch, f.needs, f"compute_advantages(estimator={estimator!r})")
    fields = ADVANTAGES.get(estimator)(batch, **kwargs)
    out = batch.copy()
    for k, v in fields.items():
        out.set(k, v)
    return out
