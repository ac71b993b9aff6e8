"""Policy objectives: per-token losses ``[B, T]`` *before* aggregation.

Every objective has the signature ``fn(logprobs, old_logprobs, advantages, mask, **scalars)``
with ``[B, T]`` tensors (``logprobs`` carries the gradient, ``old`` is the behaviour policy)
and returns an :class:`Objective` record: the per-token ``loss`` and per-token ``metrics``
(e.g. a 0/1 ``clipped`` indicator) that the adapter averages over the mask.
Notation: ``r = exp(clamp(lp − old, ±20))``, ``sg`` = stop-gradient, ``|o_i| = Σ_t m``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperrl.registry import AboveOne, Fraction, NonNegative, Positive, Registry

__all__ = [
    "OBJECTIVES",
    "register_objective",
    "Objective",
    "ppo_clip",
    "gspo",
    "cispo",
    "sapo",
    "gmpo",
    "reinforce",
    "dppo_tv",
    "dppo_kl",
    "dro",
    "topr",
    "clip_cov",
    "kl_cov",
    "value_loss",
    "log_ratio",
]

OBJECTIVES: Registry = Registry("policy objective")
register_objective = OBJECTIVES.register


class Objective(NamedTuple):
    """What an objective returns: the per-token ``loss`` ``[B, T]`` (before aggregation) and its metrics."""

    loss: torch.Tensor  # [B, T] per-token loss
    metrics: dict  # name -> [B, T] per-token values (detached), averaged over the mask


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """``clamp(lp − old, −c, c)`` (the exp of ±20 stays finite in fp32)."""
    return torch.clamp(logprobs - old_logprobs, -clamp, clamp)


def _clip_loss(ratio, adv, clip_low, clip_high, dual_clip=None, delta=None):
    unclipped_r = ratio if delta is None else torch.clamp(ratio, max=delta)
    l1 = -adv * unclipped_r
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(l1, l2)
    clipped = (l2 > l1).float()
    if dual_clip is not None:
        l3 = -adv * dual_clip
        dual = (adv < 0) & (loss > l3)
        loss = torch.where(adv < 0, torch.minimum(loss, l3), loss)
        return loss, {"clipped": clipped.detach(), "dual_clipped": dual.float().detach()}
    return loss, {"clipped": clipped.detach()}


@register_objective("ppo_clip")
def ppo_clip(logprobs, old_logprobs, advantages, mask, *, clip_low: NonNegative = 0.2, clip_high: NonNegative = 0.2,
             dual_clip: AboveOne | None = None, delta: Positive | None = None, log_ratio_clamp: Positive = 20.0
             ) -> Objective:
    """PPO clipped surrogate (Schulman et al. 2017) with DAPO clip-higher (Yu et al. 2025).

    ``L = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))``. ``dual_clip=c`` (Ye et al. 2020):
    for ``A < 0``, ``L = min(L, −A·c)`` (verl: c = 3 always; OpenRLHF: opt-in). ``delta``
    (TRL, INTELLECT-2): also cap r at δ on the unclipped branch. DAPO: ε_low 0.2, ε_high 0.28.
    """
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, log_ratio_clamp))
    loss, metrics = _clip_loss(ratio, advantages, clip_low, clip_high, dual_clip, delta)
    return Objective(loss, {**metrics, "ratio": ratio.detach()})


def _seq_mean(x, mask):
    m = mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp_min(1)


@register_objective("gspo")
def gspo(logprobs, old_logprobs, advantages, mask, *, clip_low: NonNegative = 3e-4, clip_high: NonNegative = 4e-4,
         log_ratio_max: Positive = 10.0) -> Objective:
    """GSPO (Zheng et al. 2025): sequence-level ratio ``s_i = exp(Σ_t m(lp−old)/|o_i|)``.

    Token form ``log r_t = lp_t − sg(lp_t) + sg(log s_i)`` (clamped at ``log_ratio_max``), then
    the PPO clip with ε = (3e-4, 4e-4). verl 0.9.1 aggregates it by ``loss_agg_mode`` (default
    token-mean; older verl forced seq-mean-token-mean). Value: every
    token of a sequence carries ``s_i``; gradient: ``s_i·∇lp_t``.
    """
    log_s = _seq_mean(logprobs - old_logprobs, mask)
    log_r = logprobs - logprobs.detach() + log_s.detach()[:, None]
    ratio = torch.exp(torch.clamp(log_r, max=log_ratio_max))
    loss, metrics = _clip_loss(ratio, advantages, clip_low, clip_high)
    return Objective(loss, {**metrics, "ratio": ratio.detach()})


@register_objective("cispo")
def cispo(logprobs, old_logprobs, advantages, mask, *, clip_mode="upper", eps_max: Positive = 5.0,
          clip_low: NonNegative = 0.2, clip_high: NonNegative = 0.28, log_ratio_clamp: Positive = 20.0) -> Objective:
    """CISPO (MiniMax-M1, 2025): ``L = −sg(clip(r))·A·lp`` — every token keeps a gradient.

    ``clip_mode="upper"`` (MiniMax, TRL): ``min(r, eps_max)``; ``"two_sided"`` (verl):
    ``clip(r, 1−clip_low, 1+clip_high)``.
    """
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, log_ratio_clamp)).detach()
    if clip_mode == "upper":
        w = torch.clamp(ratio, max=eps_max)
    elif clip_mode == "two_sided":
        w = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    else:
        raise ValueError(f"clip_mode={clip_mode!r}; choose 'upper' (MiniMax/TRL) or 'two_sided' (verl)")
    return Objective(-w * advantages * logprobs, {"clipped": (w != ratio).float(), "ratio": ratio})


@register_objective("sapo")
def sapo(logprobs, old_logprobs, advantages, mask, *, tau_pos: Positive = 1.0, tau_neg: Positive = 1.05,
         log_ratio_clamp: Positive = 20.0) -> Objective:
    """SAPO soft gate (Qwen 2025): ``L = −f(r)·A``, ``f(r) = σ(τ(r−1))·4/τ`` with τ = tau_pos
    if A > 0 else tau_neg. ``f'(1) = 1``, so on-policy it is REINFORCE. verl 0.9.1 aggregates it
    with seq-mean-token-mean whatever its ``loss_agg_mode`` (the ``sapo`` recipe does the same)."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, log_ratio_clamp))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return Objective(-gate * advantages, {"ratio": ratio.detach()})


@register_objective("gmpo")
def gmpo(logprobs, old_logprobs, advantages, mask, *, clip_low: NonNegative = 0.4, clip_high: NonNegative = 0.4
         ) -> Objective:
    """GMPO geometric-mean policy optimisation (Zhao et al. 2025).

    Sign-aware clip of ``d = lp − old`` in log space to ``(−ε_low, ε_high)``:
    ``d' = sgn(A)·min(sgn(A)·d, sgn(A)·clip(d))``; ``ratio_i = exp(Σ_t m·d' / |o_i|)``;
    per-sequence loss ``−Â_i·ratio_i`` (``Â_i`` = mean action advantage) on every token — use
    ``seq-mean-token-mean`` to get ``mean_i``.
    """
    d = logprobs - old_logprobs
    sgn = torch.sign(advantages)
    d_clip = sgn * torch.minimum(sgn * d, sgn * torch.clamp(d, -clip_low, clip_high))
    ratio = torch.exp(_seq_mean(d_clip, mask))
    adv_seq = _seq_mean(advantages, mask)
    loss = (-adv_seq * ratio)[:, None].expand_as(logprobs)
    return Objective(loss, {"clipped": (d_clip != d).float().detach()})


@register_objective("reinforce")
def reinforce(logprobs, old_logprobs, advantages, mask) -> Objective:
    """REINFORCE / GPG: ``L = −A·lp`` (multiply by detached IS weights in the adapter)."""
    return Objective(-advantages * logprobs, {})


def _dppo(logprobs, old_logprobs, advantages, keep_pos, keep_neg, clip_ratio_c, log_ratio_clamp):
    """The DPPO loss given its trust-region tests: ``−A·sg(min(r, c))·lp`` on the tokens kept (``keep_pos``
    where ``A > 0``, ``keep_neg`` elsewhere), 0 on the masked ones."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs, log_ratio_clamp))
    w = torch.clamp(ratio, max=clip_ratio_c).detach()
    keep = torch.where(advantages > 0, keep_pos, keep_neg).detach().to(logprobs.dtype)
    return Objective(-advantages * w * logprobs * keep,
                     {"clipped": (1.0 - keep), "truncated": (ratio > clip_ratio_c).to(keep.dtype).detach() * keep,
                      "ratio": ratio.detach()})


@register_objective("dppo_tv")
def dppo_tv(logprobs, old_logprobs, advantages, mask, *, clip_low: NonNegative = 0.2, clip_high: NonNegative = 0.2,
            clip_ratio_c: Positive = 3.0, log_ratio_clamp: Positive = 20.0) -> Objective:
    """DPPO-Binary-TV (arXiv 2602.04879; verl 0.9 ``loss_mode=dppo_tv``): a trust region on the sampled
    token's *probability*. With ``p = exp(lp)``, ``p_old = exp(old)``: a token with ``A > 0`` is kept while
    ``p − p_old ≤ ε_high``, one with ``A ≤ 0`` while ``p − p_old ≥ −ε_low``; kept tokens take the truncated-IS
    REINFORCE term ``L = −A·sg(min(r, c))·lp``, masked ones 0 (no gradient). verl's names: ε = ``clip_ratio``
    / ``clip_ratio_low`` / ``clip_ratio_high`` (0.2), ``c = clip_ratio_c`` — 3.0 in verl's ``ActorConfig``
    (the function's own fallback, 20, applies only to a config without the key). Metrics: ``clipped`` (masked),
    ``truncated`` (kept with ``r > c``, verl's ``pg_clipfrac_lower``)."""
    dp = torch.exp(logprobs) - torch.exp(old_logprobs)
    return _dppo(logprobs, old_logprobs, advantages, dp <= clip_high, dp >= -clip_low, clip_ratio_c, log_ratio_clamp)


@register_objective("dppo_kl")
def dppo_kl(logprobs, old_logprobs, advantages, mask, *, clip_low: NonNegative = 0.2, clip_high: NonNegative = 0.2,
            clip_ratio_c: Positive = 3.0, log_ratio_clamp: Positive = 20.0) -> Objective:
    """DPPO-Binary-KL (arXiv 2602.04879; verl 0.9 ``loss_mode=dppo_kl``): as :func:`dppo_tv` with the binary
    KL of the sampled token's Bernoulli ``KL_bin = p_old·(old − lp) + (1 − p_old)·log((1 − p_old + 1e-8) /
    (1 − p + 1e-8))`` as the divergence: ``A > 0`` keeps ``KL_bin ≤ ε_high or p ≤ p_old``, ``A ≤ 0`` keeps
    ``KL_bin ≤ ε_low or p ≥ p_old``; ``L = −A·sg(min(r, c))·lp`` on the kept tokens. verl's names and
    defaults (ε 0.2, ``clip_ratio_c`` 3.0 from its ``ActorConfig``)."""
    p, p_old = torch.exp(logprobs), torch.exp(old_logprobs)
    kl = p_old * (old_logprobs - logprobs) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    return _dppo(logprobs, old_logprobs, advantages, (kl <= clip_high) | (p <= p_old), (kl <= clip_low) | (p >= p_old),
                 clip_ratio_c, log_ratio_clamp)


@register_objective("dro")
def dro(logprobs, old_logprobs, advantages, mask, *, beta: Positive) -> Objective:
    """DRO, direct reward optimisation with a quadratic log-ratio penalty (verl 0.9 ``loss_mode=dro``):
    ``L = −(lp·A − β/2·(lp − old)²)``. ``beta`` is verl's ``policy_loss.dro_beta`` — required there too
    (verl refuses a missing or non-positive one)."""
    d = logprobs - old_logprobs
    return Objective(-(logprobs * advantages - 0.5 * beta * d.square()), {"log_ratio_sq": d.detach().square()})


@register_objective("topr")
def topr(logprobs, old_logprobs, advantages, mask, *, level: str = "token", positive_coef: NonNegative = 1.0,
         negative_coef: NonNegative = 1.0, log_ratio_clamp: Positive = 20.0) -> Objective:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025, arXiv 2503.14286; ROLL): a plain
    supervised term on positive samples and a truncated importance weight on the rest —
    ``A > 0``: ``L = −c₊·A·lp``; ``A ≤ 0``: ``L = −c₋·sg(clip(π/μ, 0, 1))·A·lp`` with ``π/μ`` the ratio to the
    behaviour policy (``old``): per token (``level="token"``) or of the whole sequence
    (``"sequence"``: ``exp(Σ_t m·(lp − old))``, the paper's trajectory ratio). ``c₊`` / ``c₋`` are ROLL's
    ``positive_loss_coef`` / ``use_topr_neg_loss_coef``. Metric ``tapered``: negative tokens whose weight < 1."""
    d = log_ratio(logprobs, old_logprobs, log_ratio_clamp)
    if level == "sequence":
        d = torch.clamp((d * mask.to(d.dtype)).sum(-1, keepdim=True), -log_ratio_clamp, log_ratio_clamp).expand_as(d)
    elif level != "token":
        raise ValueError(f"level={level!r}; choose 'token' (ROLL) or 'sequence' (the paper's trajectory ratio)")
    w = torch.clamp(torch.exp(d), 0.0, 1.0).detach()
    pos = advantages > 0
    weight = torch.where(pos, torch.full_like(w, positive_coef), negative_coef * w)
    return Objective(-weight * advantages * logprobs, {"tapered": ((~pos) & (w < 1)).to(w.dtype), "ratio": w})


def _covariance(logprobs, advantages, mask):
    m = mask.bool()
    n = m.sum().clamp_min(1)
    a, lp = advantages.detach(), logprobs.detach()
    a_mu = torch.where(m, a, 0).sum() / n
    lp_mu = torch.where(m, lp, 0).sum() / n
    return torch.where(m, (a - a_mu) * (lp - lp_mu), torch.full_like(a, float("-inf")))


@register_objective("clip_cov")
def clip_cov(logprobs, old_logprobs, advantages, mask, *, clip_low: NonNegative = 0.2, clip_high: NonNegative = 0.2,
             clip_cov_ratio: Fraction = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0,
             generator: torch.Generator | None = None) -> Objective:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism"): PPO clip, plus the gradient of a
    random subset of ``⌈ratio·N⌉`` tokens whose covariance ``(A−Ā)(lp−l̄p)`` lies in
    ``[cov_lb, cov_ub]`` is cut (their loss is 0). The subset is drawn with ``generator``."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    loss, metrics = _clip_loss(ratio, advantages, clip_low, clip_high)
    cov = _covariance(logprobs, advantages, mask)
    eligible = (cov >= cov_lb) & (cov <= cov_ub)
    k = max(1, int(clip_cov_ratio * int(mask.bool().sum())))
    noise = torch.rand(cov.shape, generator=generator, device=cov.device)
    score = torch.where(eligible, noise, -1.0).flatten()
    top = torch.topk(score, min(k, score.numel())).indices
    picked = torch.zeros_like(score, dtype=torch.bool).index_fill(0, top, True).view_as(cov) & eligible
    loss = torch.where(picked, torch.zeros_like(loss), loss)
    return Objective(loss, {**metrics, "cov_cut": picked.float()})


@register_objective("kl_cov")
def kl_cov(logprobs, old_logprobs, advantages, mask, *, kl_cov_ratio: Fraction = 2e-3, kl_coef: NonNegative = 1.0
           ) -> Objective:
    """KL-Cov (Cui et al. 2025): ``L = −A·r``, plus ``kl_coef·|lp − old|`` on the top
    ``⌈ratio·N⌉`` tokens by covariance ``(A−Ā)(lp−l̄p)``."""
    ratio = torch.exp(log_ratio(logprobs, old_logprobs))
    cov = _covariance(logprobs, advantages, mask)
    k = max(1, int(kl_cov_ratio * int(mask.bool().sum())))
    flat = cov.flatten()
    top = torch.topk(flat, min(k, flat.numel())).indices
    picked = torch.zeros_like(flat, dtype=torch.bool).index_fill(0, top, True).view_as(cov) & mask.bool()
    loss = -advantages * ratio + torch.where(picked, kl_coef * (logprobs - old_logprobs).abs(), 0)
    return Objective(loss, {"kl_penalised": picked.float(), "ratio": ratio.detach()})


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.2) -> Objective:
    """Clipped critic loss: ``½·max((V−R)², (clip(V, V_old ± c) − R)²)`` per token ``[B, T]``.

    ``clip=None`` gives the plain ``½(V−R)²``. Metric ``clipped``: the clipped branch is larger.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return Objective(0.5 * unclipped, {})
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clip - returns) ** 2
    return Objective(0.5 * torch.maximum(unclipped, clipped), {"clipped": (clipped > unclipped).float().detach()})
