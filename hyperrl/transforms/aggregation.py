"""Loss aggregation (``loss_agg_mode``) with explicit global normalisers.

Every mode is ``Σ (…) / normaliser``. The normalisers are *arguments*: pass the counts of the
whole optimizer step (all micro-batches, all data-parallel ranks — :meth:`Normalizer.from_mask`
per micro-batch, then ``+`` / all-reduce) and summing the per-micro-batch losses reproduces the
full-batch loss and gradient exactly. Left as ``None`` they default to the local counts.

========================  ======================================================================
mode                      value
========================  ======================================================================
token-mean                ``Σ_{i,t} L·m / N_tokens``
token-sum                 ``Σ_{i,t} L·m``
seq-mean-token-mean       ``Σ_i (Σ_t L·m / |o_i|) / N_seqs`` (fully masked sequences excluded)
seq-mean-token-sum        ``Σ_i Σ_t L·m / N_seqs``
seq-mean-token-sum-norm   ``Σ_i Σ_t L·m / (N_seqs · L_const)`` (Dr. GRPO; ``L_const`` required,
                          e.g. the max response length — a constant, never a batch statistic)
seq-mean-length-weighted  LUSPO ``mean_i(l_i·|o_i|)`` with ``l_i`` the sequence's token-mean
                          loss; numerically equal to ``seq-mean-token-sum``
========================  ======================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperrl.registry import Registry

__all__ = ["AGGREGATIONS", "register_aggregation", "Normalizer", "aggregate"]


@dataclass(frozen=True)
class Normalizer:
    """Global counts of one optimizer step (tensors or numbers)."""

    num_tokens: torch.Tensor | float | None = None  # Σ m over the whole step
    num_seqs: torch.Tensor | float | None = None  # sequences with ≥ 1 action token
    length_const: float | None = None  # L_const of seq-mean-token-sum-norm

    @staticmethod
    def from_mask(mask: torch.Tensor, length_const: float | None = None) -> Normalizer:
        m = mask.bool()
        return Normalizer(m.sum().float(), m.any(-1).sum().float(), length_const)

    def __add__(self, other: Normalizer) -> Normalizer:
        if self.length_const != other.length_const:
            raise ValueError(f"length_const: {self.length_const} vs {other.length_const}; it must be one constant")
        return Normalizer(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs, self.length_const)


AGGREGATIONS: Registry = Registry("aggregation mode")
register_aggregation = AGGREGATIONS.register


def _masked(loss, mask):
    return torch.where(mask.bool(), loss, torch.zeros_like(loss))


def _tok(mask, norm):
    return mask.bool().sum().float() if norm.num_tokens is None else norm.num_tokens


def _seq(mask, norm):
    return mask.bool().any(-1).sum().float() if norm.num_seqs is None else norm.num_seqs


@register_aggregation("token-mean")
def token_mean(loss, mask, norm: Normalizer):
    """``token-mean``: ``Σ_{i,t} L·m / N_tokens`` of ``loss`` ``[B, T]`` under ``mask`` ``[B, T]`` → scalar."""
    return _masked(loss, mask).sum() / torch.as_tensor(_tok(mask, norm)).clamp_min(1)


@register_aggregation("token-sum")
def token_sum(loss, mask, norm: Normalizer):
    """``token-sum``: ``Σ_{i,t} L·m`` of ``loss`` ``[B, T]`` under ``mask`` ``[B, T]`` → scalar (no normaliser)."""
    return _masked(loss, mask).sum()


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, norm: Normalizer):
    """``seq-mean-token-mean``: ``Σ_i (Σ_t L·m / |o_i|) / N_seqs`` over ``[B, T]`` → scalar (fully masked
    rows add 0 and are not counted in ``N_seqs``)."""
    per_seq = _masked(loss, mask).sum(-1) / mask.bool().sum(-1).clamp_min(1)
    return per_seq.sum() / torch.as_tensor(_seq(mask, norm)).clamp_min(1)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, norm: Normalizer):
    """``seq-mean-token-sum``: ``Σ_i Σ_t L·m / N_seqs`` of ``loss`` ``[B, T]`` under ``mask`` → scalar."""
    return _masked(loss, mask).sum() / torch.as_tensor(_seq(mask, norm)).clamp_min(1)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss, mask, norm: Normalizer):
    """``seq-mean-token-sum-norm`` (Dr. GRPO): ``Σ_i Σ_t L·m / (N_seqs · L_const)`` over ``[B, T]`` → scalar;
    ``norm.length_const`` (a constant, e.g. the max response length) is required."""
    if norm.length_const is None:
        raise ValueError("length_const: seq-mean-token-sum-norm needs a constant (e.g. max response length)")
    return _masked(loss, mask).sum() / (torch.as_tensor(_seq(mask, norm)).clamp_min(1) * norm.length_const)


@register_aggregation("seq-mean-length-weighted")
def seq_mean_length_weighted(loss, mask, norm: Normalizer):
    """``seq-mean-length-weighted`` (LUSPO): ``Σ_i l_i·|o_i| / N_seqs`` with ``l_i`` the sequence's token-mean
    loss, over ``[B, T]`` → scalar; numerically equal to ``seq-mean-token-sum``."""
    n = mask.bool().sum(-1)
    per_seq = _masked(loss, mask).sum(-1) / n.clamp_min(1)
    return (per_seq * n).sum() / torch.as_tensor(_seq(mask, norm)).clamp_min(1)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens=None,
    num_seqs=None,
    length_const: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` under ``mask`` ``[B, T]`` to a scalar (see module table)."""
    if loss.shape != mask.shape:
        raise ValueError(f"loss {list(loss.shape)} and mask {list(mask.shape)} must have the same shape [B, T]")
    return AGGREGATIONS.get(mode)(loss, mask, Normalizer(num_tokens, num_seqs, length_const))
