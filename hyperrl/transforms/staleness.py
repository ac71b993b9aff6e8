"""Staleness of off-policy tokens and the proximal policy of decoupled PPO.

In asynchronous RL every action token carries the version ``v_t`` of the weights that sampled it
(``token_version [B, T]``; ``NO_VERSION = −1`` on prompt, observation and padding tokens). A
learner holding version ``V`` (the weights that train the batch; its update produces ``V + 1``)
sees each token ``s_t = V − v_t ≥ 0`` updates late. A bound ``η`` (``async.max_staleness``)
requires ``s_t ≤ η`` on every trained token; the admission rule of
:mod:`hyperrl.loop.admission` guarantees it by construction, :func:`staleness_mask` and
:func:`staleness_metrics` check and report it.

Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025) separates the trust-region anchor
``π_prox`` (the learner's version ``V``: ``r = π_θ / π_prox`` is clipped) from the behaviour
correction ``π_prox / π_behav`` (detached, truncated or masked). ``π_prox`` is either recomputed
(``old_logprobs``: one forward of version ``V``) or approximated without a forward by A-3PO (Wu et
al. 2025, arXiv 2512.06547): with ``v_θ = V + 1`` the policy being optimised and ``v_prox = V``,

    α_t = (v_prox − v_t) / (v_θ − v_t),   log π_prox ≈ log π_behav + α_t (log π_θ − log π_behav)

(``"loglinear"``; ``"linear"`` interpolates the probabilities). A fresh token (``v_t = V``) gets
``α = 0``: its proximal policy *is* its behaviour policy; a token ``k`` versions old gets
``α = k / (k + 1)``.
"""

from __future__ import annotations

import torch

__all__ = [
    "NO_VERSION",
    "token_staleness",
    "staleness_mask",
    "staleness_metrics",
    "row_policy_version",
    "proximal_alpha",
    "interpolated_proximal_logprobs",
]

NO_VERSION = -1  # token_version on tokens no policy sampled (prompt, observation, tool output, padding)


def _check_versions(token_version: torch.Tensor, mask: torch.Tensor, version: int) -> torch.Tensor:
    if token_version.shape != mask.shape:
        raise ValueError(f"token_version: shape {list(token_version.shape)}, expected {list(mask.shape)} [B, T]")
    m = mask.bool()
    if bool((token_version[m] < 0).any()):
        b, t = (m & (token_version < 0)).nonzero()[0].tolist()
        raise ValueError(f"token_version: action token [{b}, {t}] has no version ({int(token_version[b, t])}); "
                         "the engine must stamp every sampled token with the version it served")
    if bool((token_version[m] > version).any()):
        b, t = (m & (token_version > version)).nonzero()[0].tolist()
        raise ValueError(f"token_version: token [{b}, {t}] was sampled at version {int(token_version[b, t])}, "
                         f"newer than the learner's version {version}")
    return m


def token_staleness(token_version: torch.Tensor, mask: torch.Tensor, version: int) -> torch.Tensor:
    """``s_t = V − v_t`` on the mask, 0 elsewhere ``[B, T]`` (int64). ``V`` = the learner's version."""
    m = _check_versions(token_version, mask, version)
    return torch.where(m, version - token_version, 0).long()


def staleness_mask(token_version: torch.Tensor, mask: torch.Tensor, version: int, max_staleness: int):
    """Keep-mask ``m ∧ (V − v_t ≤ η)`` ``[B, T]`` (bool)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness: {max_staleness} < 0; η counts versions and must be ≥ 0")
    return mask.bool() & (token_staleness(token_version, mask, version) <= max_staleness)


def row_policy_version(token_version: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A row's ``policy_version``: its *oldest* action token's version ``min_t v_t`` ``[B]``;
    ``NO_VERSION`` for a row without action tokens."""
    m = mask.bool()
    big = torch.iinfo(torch.int64).max
    low = torch.where(m, token_version.long(), big).min(-1).values
    return torch.where(m.any(-1), low, NO_VERSION)


def staleness_metrics(token_version: torch.Tensor, mask: torch.Tensor, version: int,
                      max_staleness: int | None = None) -> dict[str, torch.Tensor]:
    """Detached diagnostics over action tokens: ``staleness_max``, ``staleness_mean`` (per token),
    ``staleness_row_mean`` (per row, of the row's oldest token), ``partial_rows_frac`` (rows whose
    tokens span several versions: resumed across a publication) and, with ``η``,
    ``staleness_at_bound_frac`` (tokens exactly ``η`` stale) and ``staleness_over_bound`` (count > η)."""
    m = _check_versions(token_version, mask, version)
    s = (version - token_version.long())[m].float()
    z = torch.zeros(())
    rows = m.any(-1)
    big = torch.iinfo(torch.int64).max
    hi = torch.where(m, token_version.long(), -1).max(-1).values
    lo = torch.where(m, token_version.long(), big).min(-1).values
    out = {
        "staleness_max": s.max() if s.numel() else z,
        "staleness_mean": s.mean() if s.numel() else z,
        "staleness_row_mean": (version - lo[rows]).float().mean() if bool(rows.any()) else z,
        "partial_rows_frac": (hi[rows] != lo[rows]).float().mean() if bool(rows.any()) else z,
    }
    if max_staleness is not None:
        out["staleness_at_bound_frac"] = (s == max_staleness).float().mean() if s.numel() else z
        out["staleness_over_bound"] = (s > max_staleness).sum().float()
    return out


def proximal_alpha(token_version: torch.Tensor, mask: torch.Tensor, version: int) -> torch.Tensor:
    """A-3PO's weight ``α_t = (V − v_t) / (V + 1 − v_t)`` on the mask, 0 elsewhere ``[B, T]``
    (``v_prox = V``, ``v_θ = V + 1``; the denominator is ≥ 1 because ``v_t ≤ V``)."""
    s = token_staleness(token_version, mask, version).float()
    return torch.where(mask.bool(), s / (s + 1.0), 0.0)


def interpolated_proximal_logprobs(behaviour_logprobs: torch.Tensor, logprobs: torch.Tensor,
                                   token_version: torch.Tensor, mask: torch.Tensor, version: int, *,
                                   method: str = "loglinear") -> torch.Tensor:
    """A-3PO: ``log π_prox`` approximated from the behaviour log-probs (the rollout's) and the current
    policy's ``logprobs`` ``[B, T]`` — no proximal forward. Detached; 0 off the mask.

    ``"loglinear"``: ``b + α (c − b)``; ``"linear"``: ``log((1 − α) e^b + α e^c)``.
    """
    if behaviour_logprobs.shape != logprobs.shape:
        raise ValueError(f"logprobs: shape {list(logprobs.shape)}, expected {list(behaviour_logprobs.shape)}")
    a = proximal_alpha(token_version, mask, version)
    b, c = behaviour_logprobs.detach().float(), logprobs.detach().float()
    if method == "loglinear":
        out = b + a * (c - b)
    elif method == "linear":  # log((1−α)·e^b + α·e^c); log(0) = −inf is harmless inside logaddexp
        out = torch.logaddexp(torch.log1p(-a) + b, torch.log(a) + c)
    else:
        raise ValueError(f"method={method!r}; choose 'loglinear' or 'linear'")
    return torch.where(mask.bool(), out, 0.0)
