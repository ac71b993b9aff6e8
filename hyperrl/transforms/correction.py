"""Training–inference mismatch correction (importance weights and rejection masks).

The log-ratio ``Δ = a − b`` is ``old − rollout`` (decoupled: a recomputed behaviour policy) or
``lp − rollout`` (bypass), clamped to ±20. Token IS ``w_t = exp(Δ_t)``; sequence IS
``w_i = exp(Σ_t m·Δ_t)`` (a product of token ratios, not a mean). Weights are always detached.
TIS truncates ``min(w, C)``; MIS / IcePop zeroes (masks) weights outside ``[lo, hi]``.
TRL's default: sequence-level mask, C = 3. Reference: Yao et al. 2025 ("Your efficient RL
framework secretly brings you off-policy RL training"), IcePop (Ling Team 2025).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperrl.registry import Positive, Registry
from hyperrl.transforms.kl import kl_penalty

__all__ = [
    "CORRECTIONS",
    "register_correction",
    "Correction",
    "mismatch_log_ratio",
    "importance_weights",
    "truncated_is",
    "masked_is",
    "rejection_mask",
    "mismatch_metrics",
    "binary_kl",
    "kpop_mask",
    "opsm_mask",
    "m2po_mask",
    "m2po_threshold",
    "m2po_global_mask",
]


class Correction(NamedTuple):
    """A mismatch correction for ``policy_loss(correction=...)``: detached per-token weights and the keep-mask."""

    weights: torch.Tensor  # [B, T] detached multiplicative weights (0 off the mask)
    mask: torch.Tensor  # [B, T] bool: tokens kept in the loss


def mismatch_log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, *, clamp: float = 20.0):
    """``clamp(a − b, ±clamp)`` on the mask, 0 elsewhere ``[B, T]`` (detached)."""
    return torch.where(mask.bool(), torch.clamp((a - b).detach(), -clamp, clamp), 0)


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, *, level: str = "token") -> torch.Tensor:
    """Token ``exp(Δ_t)`` or sequence ``exp(Σ_t Δ_t)`` (broadcast to tokens) weights ``[B, T]``."""
    if level == "token":
        lw = log_ratio
    elif level == "sequence":
        lw = torch.clamp(log_ratio.sum(-1, keepdim=True), -20.0, 20.0).expand_as(log_ratio)
    else:
        raise ValueError(f"level={level!r}; choose 'token' or 'sequence'")
    return torch.where(mask.bool(), torch.exp(lw), 0)


def truncated_is(log_ratio, mask, *, cap: float = 2.0, level: str = "token") -> Correction:
    """TIS: ``min(w, cap)``; every token kept."""
    w = torch.clamp(importance_weights(log_ratio, mask, level=level), max=cap)
    return Correction(w, mask.bool())


def masked_is(log_ratio, mask, *, lo: float = 0.5, hi: float = 2.0, level: str = "token") -> Correction:
    """MIS / IcePop: keep the weight where ``lo ≤ w ≤ hi``, drop the token (mask 0) elsewhere."""
    w = importance_weights(log_ratio, mask, level=level)
    keep = mask.bool() & (w >= lo) & (w <= hi)
    return Correction(torch.where(keep, w, 0), keep)


def rejection_mask(a, b, mask, *, estimator: str = "k3", threshold: Positive = 1e-2, level: str = "sequence"):
    """Reject tokens (``level="token"``) or whole sequences (mean over the sequence's tokens)
    whose KL statistic ``kX(a − b)`` exceeds ``threshold``. Returns a bool keep-mask ``[B, T]``."""
    m = mask.bool()
    stat = torch.where(m, kl_penalty(a.detach(), b.detach(), estimator).abs(), 0)
    if level == "token":
        return m & (stat <= threshold)
    if level == "sequence":
        seq = stat.sum(-1) / m.sum(-1).clamp_min(1)
        return m & (seq <= threshold)[:, None]
    raise ValueError(f"level={level!r}; choose 'token' or 'sequence'")


def binary_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``D_B(p‖q) = p·log(p/q) + (1−p)·log((1−p)/(1−q))`` — the KL between two Bernoullis (the sampled token
    or not), both clamped to ``[1e-8, 1 − 1e-8]`` (AReaL's ``compute_binary_kl_divergence``)."""
    p, q = p.clamp(1e-8, 1 - 1e-8), q.clamp(1e-8, 1 - 1e-8)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def kpop_mask(prox_logprobs, behave_logprobs, mask, *, upper: float = 2.0) -> torch.Tensor:
    """KPop (AReaL PR #1405): keep a token iff ``max(D_B(p‖q), D_B(q‖p)) ≤ upper``, ``p = π_prox(y_t)``,
    ``q = π_behave(y_t)``. Bool ``[B, T]``."""
    p, q = torch.exp(prox_logprobs.detach().float()), torch.exp(behave_logprobs.detach().float())
    return mask.bool() & (torch.maximum(binary_kl(p, q), binary_kl(q, p)) <= upper)


def opsm_mask(behave_logprobs, logprobs, advantages, mask, *, delta: float = 1e-4) -> torch.Tensor:
    """OPSM, off-policy sequence masking (DeepSeek-V3.2; slime ``compute_opsm_mask``, TRL
    ``get_off_policy_mask``): drop the tokens of a sequence whose advantage is negative and whose mean log-ratio
    to the behaviour policy ``Σ_t m·(log μ − log π_θ) / Σ_t m`` exceeds ``delta`` (both strict; ``log π_θ`` the
    current policy, detached). Bool keep-mask ``[B, T]``."""
    m = mask.bool()
    d = torch.where(m, behave_logprobs.detach().float() - logprobs.detach().float(), 0.0)
    seq_kl = d.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    return m & ~((advantages < 0) & (seq_kl > delta))


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, tau: float = 0.04) -> torch.Tensor:
    """M2PO (arXiv 2510.01161; AReaL ``_get_m2po_loss_mask``): drop the tokens with the largest ``m2 = (log r)²``
    until the mean of ``m2`` over the kept tokens is below ``tau`` (strict) — sorted descending, the first ``i``
    whose tail mean ``mean(m2[i:]) < tau`` drops the ``i`` largest; none below: all but the smallest dropped.
    Bool keep-mask ``[B, T]`` (no valid token: the mask unchanged)."""
    if tau <= 0:
        raise ValueError(f"algo.correction.tau={tau}: M2PO's second-moment bound must be > 0")
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return m
    m2 = log_ratio.detach().float()[m].square()
    order = torch.argsort(m2, descending=True, stable=True)
    drop = _m2po_drop(m2[order], tau)
    keep = torch.ones(n, dtype=torch.bool, device=m.device)
    keep[order[:drop]] = False
    out = torch.zeros_like(m)
    out[m] = keep
    return out


def m2po_threshold(m2: torch.Tensor, *, tau: float = 0.04) -> float:
    """The smallest second moment M2PO drops from the 1-D values ``m2`` (all the step's tokens): sorted
    descending, the first ``i`` with ``mean(m2[i:]) < tau`` drops ``m2[:i]`` → ``m2[i − 1]``; nothing dropped →
    ``inf``; none below ``tau`` → all but the smallest dropped."""
    if tau <= 0:
        raise ValueError(f"algo.correction.tau={tau}: M2PO's second-moment bound must be > 0")
    n = m2.numel()
    if n == 0:
        return float("inf")
    s = torch.sort(m2.float(), descending=True).values
    drop = _m2po_drop(s, tau)
    return float(s[drop - 1]) if drop else float("inf")


def _m2po_drop(s: torch.Tensor, tau: float) -> int:
    """How many of the descending second moments ``s`` (non-empty) M2PO drops: the first ``i`` whose tail mean
    ``mean(s[i:]) < tau``; none below: all but the smallest."""
    n = s.numel()
    tail = s.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=s.dtype, device=s.device)  # mean(s[i:])
    below = (tail < tau).nonzero()
    return int(below[0]) if len(below) else n - 1


def m2po_global_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, tau: float = 0.04, gather=None) -> torch.Tensor:
    """M2PO over the whole step (the paper's batch statistic; ``gather``: the data-parallel strategy's
    :meth:`gather_values`, so every rank cuts at the one threshold of all ranks' tokens): keep a token when its
    ``(log r)²`` is below :func:`m2po_threshold` of every token's — ties with the smallest dropped value are
    dropped too (a rule of the values alone, so the mask does not depend on how rows are sharded or
    micro-batched). Bool keep-mask ``[B, T]``."""
    m = mask.bool()
    m2 = log_ratio.detach().float().square()
    values = m2[m]
    theta = m2po_threshold(gather(values) if gather is not None else values, tau=tau)
    return m & (m2 < theta)


def mismatch_metrics(train_logprobs, rollout_logprobs, mask) -> dict:
    """Detached diagnostics: max/mean |Δ| and mean k3 over action tokens."""
    m = mask.bool()
    d = (train_logprobs - rollout_logprobs).detach()[m]
    if d.numel() == 0:
        z = torch.zeros(())
        return {"mismatch_max_abs": z, "mismatch_mean_abs": z, "mismatch_k3": z}
    return {
        "mismatch_max_abs": d.abs().max(),
        "mismatch_mean_abs": d.abs().mean(),
        "mismatch_k3": (torch.expm1(-d) + d).mean(),
    }


# ----------------------------------------------------------------------------- registry
# A correction factory maps a batch (behaviour ``old_logprobs`` recomputed by the learner,
# ``rollout_logprobs`` from the engine) to a :class:`Correction` for ``policy_loss(correction=...)``.

CORRECTIONS: Registry = Registry("mismatch correction")
register_correction = CORRECTIONS.register


def _decoupled(batch):
    return mismatch_log_ratio(batch["old_logprobs"], batch["rollout_logprobs"], batch["action_mask"])


@register_correction("tis", needs=("old_logprobs",))
def _tis(batch, *, cap: Positive = 2.0, level: str = "token") -> Correction:
    """Truncated IS ``min(π_old/π_rollout, cap)`` (Yao et al. 2025); every token kept."""
    return truncated_is(_decoupled(batch), batch["action_mask"], cap=cap, level=level)


@register_correction("mis", needs=("old_logprobs",))
def _mis(batch, *, lo: Positive = 0.5, hi: Positive = 2.0, level: str = "token") -> Correction:
    """Masked IS / IcePop: tokens whose weight leaves ``[lo, hi]`` are dropped."""
    return masked_is(_decoupled(batch), batch["action_mask"], lo=lo, hi=hi, level=level)


@register_correction("icepop", needs=("old_logprobs",))
def _icepop(batch, *, lo: Positive = 0.5, hi: Positive = 5.0) -> Correction:
    """IcePop (Ling Team 2025; verl, OpenRLHF, NeMo-RL, AReaL): per token, keep the weight
    ``π_old/π_rollout`` where it lies in ``[α, β]`` = ``[lo, hi]`` and drop the token elsewhere — exactly
    ``mis`` at ``level="token"`` (this alias fixes the level and takes IcePop's window, [0.5, 5])."""
    return masked_is(_decoupled(batch), batch["action_mask"], lo=lo, hi=hi, level="token")


@register_correction("rejection", needs=("old_logprobs",))
def _rejection(batch, *, estimator: str = "k3", threshold: Positive = 1e-2, level: str = "sequence") -> Correction:
    """Rejection sampling: drop tokens / sequences whose ``kX(old − rollout)`` exceeds ``threshold``; weight 1."""
    keep = rejection_mask(batch["old_logprobs"], batch["rollout_logprobs"], batch["action_mask"],
                          estimator=estimator, threshold=threshold, level=level)
    return Correction(keep.float(), keep)


@register_correction("kpop", needs=("old_logprobs",))
def _kpop(batch, *, upper: Positive = 2.0) -> Correction:
    """KPop (AReaL ``rejection_sampling: {metric: binary_kl, action: mask, level: token}``): tokens whose
    symmetric Bernoulli KL between the proximal (``old_logprobs``) and behaviour (``rollout_logprobs``)
    probabilities exceeds ``upper`` are dropped; the rest keep the decoupled weight ``π_prox/π_behave``
    (unclipped, as AReaL). ``upper``: AReaL's docs and ``gsm8k_kpop.yaml`` use 2.0 (its dataclass default is
    5.0; the KPop blog quotes 0.1)."""
    m = batch["action_mask"]
    keep = kpop_mask(batch["old_logprobs"], batch["rollout_logprobs"], m, upper=upper)
    w = importance_weights(_decoupled(batch), m)
    return Correction(torch.where(keep, w, 0), keep)


@register_correction("opsm", needs=("logprobs", "advantages"))
def _opsm(batch, *, delta: Positive = 1e-4, behaviour: str = "rollout") -> Correction:
    """OPSM (DeepSeek-V3.2): sequences with a negative advantage whose mean ``log μ − log π_θ`` exceeds
    ``delta`` are dropped (weight 1 elsewhere). ``logprobs``: the current policy's, which the loss hands in;
    ``behaviour``: ``"rollout"`` (the engine's, TRL's sampling log-probs and slime ``--use-rollout-logprobs``)
    or ``"old"`` (the recomputed pre-update policy, slime's default). ``delta``: slime's ``--opsm-delta``
    default 1e-4 (TRL's ``off_policy_mask_threshold`` is off by default; its docs suggest 0.5)."""
    if behaviour not in ("rollout", "old"):
        raise ValueError(f"algo.correction.behaviour={behaviour!r}; choose 'rollout' or 'old'")
    key = "rollout_logprobs" if behaviour == "rollout" else "old_logprobs"
    if key not in batch.keys():
        raise KeyError(f"opsm: the batch has no {key!r} (behaviour log-probs); OPSM needs them")
    keep = opsm_mask(batch[key], batch["logprobs"], batch["advantages"], batch["action_mask"], delta=delta)
    return Correction(keep.float(), keep)


@register_correction("m2po", needs=("old_logprobs", "m2po_keep"))
def _m2po(batch, *, tau: Positive = 0.04) -> Correction:
    """M2PO (arXiv 2510.01161) over the whole step: drop the tokens with the largest
    ``(log π_behave − log π_prox)²`` until their mean over the kept tokens is below ``tau`` (AReaL's
    ``m2_threshold``; its gsm8k example 0.04), weight 1 on the rest — the second moment of every token of the
    step on every data-parallel rank (:func:`m2po_global_mask`, computed once when the batch is prepared into
    ``m2po_keep``), so the mask is the same however the step is sharded or micro-batched."""
    if "m2po_keep" not in batch.keys():
        raise KeyError("m2po_keep: M2PO's step-wide mask is computed when the batch is prepared (the loop does it; "
                       "in Python call m2po_global_mask over the step's tokens)")
    keep = batch["m2po_keep"].bool() & batch["action_mask"].bool()
    return Correction(keep.float(), keep)


@register_correction("m2po_local", needs=("old_logprobs",))
def _m2po_local(batch, *, tau: Positive = 0.04) -> Correction:
    """M2PO as AReaL computes it: over the tokens the loss is called with (a micro-batch on this rank), the
    largest dropped by count (:func:`m2po_mask`)."""
    keep = m2po_mask(batch["rollout_logprobs"] - batch["old_logprobs"], batch["action_mask"], tau=tau)
    return Correction(keep.float(), keep)
