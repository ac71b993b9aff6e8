"""Vectorised group statistics over arbitrary integer group ids (segment sums, fp32, two-pass).

All functions have static output shapes (``[B]``), so they compile with
``torch.compile(fullgraph=True)``: group ids are densified by a sort, never by ``torch.unique``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["dense_group_index", "GroupStats", "group_stats", "segment_sum"]


def dense_group_index(group_ids: torch.Tensor) -> torch.Tensor:
    """Map arbitrary integer ids ``[B]`` to dense indices ``0..G-1`` ``[B]`` (order of first sort).

    Equal ids get equal indices; static shapes (sort + cumsum + scatter), no ``unique``.
    """
    sorted_ids, perm = torch.sort(group_ids, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.int64)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    rank_sorted = torch.cumsum(starts, 0) - 1
    return torch.empty_like(rank_sorted).scatter_(0, perm, rank_sorted)


def segment_sum(x: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """``out[g] = Σ_{i: index[i] = g} x[i]`` for ``g < size``; ``x`` ``[B]``, returns ``[size]``."""
    return torch.zeros(size, dtype=x.dtype, device=x.device).index_add(0, index, x)


class GroupStats(NamedTuple):
    """Per-sample views of its group's statistics, all ``[B]`` fp32 (``count`` int64)."""

    index: torch.Tensor  # dense group index
    count: torch.Tensor  # group size n_g
    mean: torch.Tensor  # μ_g
    std: torch.Tensor  # σ_g, unbiased (n−1); 0 for singletons
    constant: torch.Tensor  # bool: every score of the group is exactly equal (incl. singletons)


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, unbiased std and exact constancy per group, broadcast back to samples.

    Two-pass: ``μ_g = Σ s / n_g`` then ``σ²_g = Σ (s − μ_g)² / (n_g − 1)``, both in fp32
    (one-pass ``E[s²] − μ²`` leaves cancellation residue, NeMo-RL #4161). Constancy is exact
    (``min_g == max_g``), so zero-variance groups are detected without a tolerance.
    ``scores`` ``[B]`` (any float dtype), ``group_ids`` ``[B]`` integer.
    """
    s = scores.to(torch.float32)
    B = s.shape[0]
    idx = dense_group_index(group_ids)
    count = segment_sum(torch.ones_like(s), idx, B)
    mean = segment_sum(s, idx, B) / count.clamp_min(1)
    dev = s - mean[idx]
    var = segment_sum(dev * dev, idx, B) / (count - 1).clamp_min(1)
    lo = torch.full((B,), float("inf"), dtype=s.dtype).scatter_reduce(0, idx, s, "amin")
    hi = torch.full((B,), float("-inf"), dtype=s.dtype).scatter_reduce(0, idx, s, "amax")
    n = count[idx]
    std = torch.where(n > 1, var[idx].sqrt(), torch.zeros_like(s))
    return GroupStats(idx, n.long(), mean[idx], std, (lo == hi)[idx])
