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
]


class Correction(NamedTuple):
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
