"""Preference losses against a frozen reference."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["DPOLoss", "dpo_loss"]


class DPOLoss(NamedTuple):
    loss_dpo: torch.Tensor  # scalar, mean over pairs
    reward_margin: torch.Tensor  # detached mean of β·(Δ_chosen − Δ_rejected)
    accuracy: torch.Tensor  # detached fraction of pairs with a positive margin


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> DPOLoss:
    """DPO sigmoid loss (Rafailov et al. 2023) over sequence log-probs ``[P]``:
    ``z = β·((π_c − ref_c) − (π_r − ref_r))``,
    ``L = −(1−ε)·log σ(z) − ε·log σ(−z)`` (ε = label smoothing, conservative DPO)."""
    z = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return DPOLoss(loss.mean(), z.detach().mean(), (z.detach() > 0).float().mean())
