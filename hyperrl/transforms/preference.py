"""Preference losses against a frozen reference (DPO and kin), over sequence log-probs of pairs.

A preference loss is registered in ``PREFERENCE_LOSSES`` (``algo.preference`` in YAML): a factory
``(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, beta, ...) -> [P]`` of
the per-pair loss, where ``chosen`` / ``rejected`` are the policy's summed log-probs of each pair's
two completions ``[P]`` (``Σ_t m·log π``), ``ref_*`` the reference's, ``*_len`` the completions'
token counts. :func:`preference_loss` turns it into a :class:`~hyperrl.transforms.loss.LossOutput`
(the mean over the step's pairs, and TRL's metrics). Peer definitions: TRL 1.16 ``DPOTrainer``
(``loss_type`` sigmoid / robust / ipo), OpenRLHF ``DPOLoss`` (conservative DPO's label smoothing).
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field

from hyperrl.registry import Positive, Registry
from hyperrl.transforms.loss import LossOutput

__all__ = ["DPOLoss", "dpo_loss", "PREFERENCE_LOSSES", "register_preference_loss", "preference_loss"]

PREFERENCE_LOSSES: Registry = Registry("preference loss")
register_preference_loss = PREFERENCE_LOSSES.register

Smoothing = Annotated[float, Field(ge=0, lt=0.5)]


class DPOLoss(NamedTuple):
    """:func:`dpo_loss`'s result: the mean loss over the pairs ``[P]``, the mean implicit reward margin
    ``z = β·Δ`` and the fraction of pairs with ``z > 0``."""

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
    loss = dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected, None, None, beta=beta,
               label_smoothing=label_smoothing)
    z = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    return DPOLoss(loss.mean(), z.detach().mean(), (z.detach() > 0).float().mean())


def _delta(chosen, rejected, ref_chosen, ref_rejected) -> torch.Tensor:
    """``Δ = (π_c − ref_c) − (π_r − ref_r)`` ``[P]``: the implicit reward margin over β."""
    return (chosen - ref_chosen) - (rejected - ref_rejected)


@register_preference_loss("dpo")
def dpo(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, beta: Positive = 0.1,
        label_smoothing: Smoothing = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023) with conservative DPO's label smoothing ε (Mitchell 2023; OpenRLHF
    ``DPOLoss``): ``L = −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)`` ``[P]``. ε = 0 is TRL's ``loss_type="sigmoid"``
    (TRL 1.16 reads ``label_smoothing`` only in its robust / EXO losses: ``robust`` below)."""
    z = beta * _delta(chosen, rejected, ref_chosen, ref_rejected)
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


@register_preference_loss("robust")
def robust(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, beta: Positive = 0.1,
           label_smoothing: Smoothing = 0.0) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024; TRL ``loss_type="robust"``): an unbiased loss under labels
    flipped with probability ε — ``L = (−(1−ε)·log σ(βΔ) + ε·log σ(−βΔ)) / (1 − 2ε)`` ``[P]``."""
    z = beta * _delta(chosen, rejected, ref_chosen, ref_rejected)
    return (-(1 - label_smoothing) * F.logsigmoid(z) + label_smoothing * F.logsigmoid(-z)) / (1 - 2 * label_smoothing)


@register_preference_loss("ipo")
def ipo(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len, *, beta: Positive = 0.1,
        length_normalize: bool = True) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17; β is the paper's τ): ``L = (Δ' − 1/(2β))²`` ``[P]``, where
    ``Δ'`` is Δ with each completion's log-ratio divided by its token count (``length_normalize``: TRL
    ``loss_type="ipo"``, as the IPO authors ran it) or the summed Δ itself (``False``: OpenRLHF)."""
    if length_normalize:
        d = (chosen - ref_chosen) / chosen_len.clamp_min(1) - (rejected - ref_rejected) / rejected_len.clamp_min(1)
    else:
        d = _delta(chosen, rejected, ref_chosen, ref_rejected)
    return (d - 1 / (2 * beta)) ** 2


def preference_loss(loss_fn, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor, *,
                    beta: float, num_pairs: torch.Tensor | float | None = None) -> LossOutput:
    """``loss_fn``'s per-pair loss (a bound :data:`PREFERENCE_LOSSES` factory) summed over these ``P``
    pairs and divided by ``num_pairs`` (the step's pairs over every micro-batch and rank; default ``P``):
    term ``loss_dpo``. Metrics (TRL's, detached, means over these pairs): ``rewards_chosen`` /
    ``rewards_rejected`` (β·(π − ref)), ``reward_margin``, ``reward_accuracy`` (chosen's implicit reward
    strictly above rejected's), ``pair_accuracy`` (the policy alone gives chosen the higher log-prob),
    ``logps_chosen`` / ``logps_rejected``."""
    P = chosen.shape[0]
    for name, t in (("rejected", rejected), ("ref_chosen", ref_chosen), ("ref_rejected", ref_rejected),
                    ("chosen_len", chosen_len), ("rejected_len", rejected_len)):
        if t.shape != (P,):
            raise ValueError(f"preference_loss: {name} has shape {tuple(t.shape)}; expected ({P},) like chosen")
    per_pair = loss_fn(chosen, rejected, ref_chosen, ref_rejected, chosen_len.float(), rejected_len.float())
    n = P if num_pairs is None else num_pairs
    rc, rr = beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()
    return LossOutput({"loss_dpo": per_pair.sum() / torch.as_tensor(n).clamp_min(1)},
                      {"rewards_chosen": rc.mean(), "rewards_rejected": rr.mean(), "reward_margin": (rc - rr).mean(),
                       "reward_accuracy": (rc > rr).float().mean(),
                       "pair_accuracy": (chosen.detach() > rejected.detach()).float().mean(),
                       "logps_chosen": chosen.detach().mean(), "logps_rejected": rejected.detach().mean()})
