"""Vectorised group statistics over arbitrary integer group ids (segment sums, fp32, two-pass).

All functions have static output shapes (``[B]``), so they compile with
``torch.compile(fullgraph=True)``: group ids are densified by a sort, never by ``torch.unique``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["dense_group_index", "GroupStats", "group_stats", "segment_sum"]


def dense_group_index(group_ids: torch.Tensor) -> torch.Tensor:
    """Map arbitrary integer ids ``[B]`` to indices in ``[0, B)`` ``[B]``; equal ids ↔ equal indices.

    Eager fast path: ids spanning fewer than ``B`` values are offset by their minimum (one
    pass, no sort). Otherwise (and always under ``torch.compile``, which cannot branch on data)
    a sort + cumsum + scatter with static shapes — never ``unique``. Indices need not be
    contiguous; every consumer sizes its segment buffers by ``B``.
    """
    if group_ids.numel() and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(group_ids)
        if int(hi) - int(lo) < group_ids.numel():
            return group_ids - lo
    sorted_ids, perm = torch.sort(group_ids, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.int64)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    rank_sorted = torch.cumsum(starts, 0) - 1
    return torch.empty_like(rank_sorted).scatter_(0, perm, rank_sorted)


def segment_sum(x: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """``out[g] = Σ_{i: index[i] = g} x[i]`` for ``g < size``; ``x`` ``[B]``, returns ``[size]``."""
    return torch.zeros(size, dtype=x.dtype, device=x.device).scatter_add(0, index, x)


class GroupStats(NamedTuple):
    """Per-sample views of its group's statistics, all ``[B]`` fp32 (``count`` int64)."""

    index: torch.Tensor  # dense group index
    count: torch.Tensor  # group size n_g
    mean: torch.Tensor  # μ_g
    std: torch.Tensor  # σ_g, unbiased (n−1); 0 for singletons
    constant: torch.Tensor  # bool: every score of the group is exactly equal (incl. singletons)


def _contiguous_group_size(idx: torch.Tensor) -> int:
    """``n`` if ``idx == arange(B) // n`` (groups contiguous and of equal size), else 0 (eager only)."""
    B = idx.numel()
    G = int(idx[-1]) + 1
    if B % G or int(idx[0]) != 0:
        return 0
    n = B // G
    return n if torch.equal(idx, torch.arange(B, device=idx.device) // n) else 0


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Mean, unbiased std and exact constancy per group, broadcast back to samples.

    Two-pass: ``μ_g = Σ s / n_g`` then ``σ²_g = Σ (s − μ_g)² / (n_g − 1)``, both in fp32
    (one-pass ``E[s²] − μ²`` leaves cancellation residue, NeMo-RL #4161). Constancy is exact
    (``min_g == max_g``), so zero-variance groups are detected without a tolerance.
    ``scores`` ``[B]`` (any float dtype), ``group_ids`` ``[B]`` integer. Contiguous equal-size
    groups (the usual rollout layout) take a reshape fast path in eager mode.
    """
    s = scores.to(torch.float32)
    B = s.shape[0]
    idx = dense_group_index(group_ids)
    n_contig = 0 if torch.compiler.is_compiling() or B == 0 else _contiguous_group_size(idx)
    if n_contig:
        x = s.view(-1, n_contig)
        mean = x.mean(1, keepdim=True)
        var = ((x - mean) ** 2).sum(1, keepdim=True) / max(n_contig - 1, 1)
        lo, hi = torch.aminmax(x, dim=1, keepdim=True)
        std = var.sqrt() if n_contig > 1 else torch.zeros_like(var)
        expand = lambda t: t.expand(-1, n_contig).reshape(B)
        count = torch.full((B,), n_contig, dtype=torch.int64, device=s.device)
        return GroupStats(idx, count, expand(mean), expand(std), expand(lo == hi))
    count = torch.bincount(idx, minlength=B).to(s.dtype)
    mean = segment_sum(s, idx, B) / count.clamp_min(1)
    mean_i = mean.index_select(0, idx)
    dev = s - mean_i
    var = segment_sum(dev * dev, idx, B) / (count - 1).clamp_min(1)
    lo = torch.full((B,), float("inf"), dtype=s.dtype).scatter_reduce(0, idx, s, "amin")
    hi = torch.full((B,), float("-inf"), dtype=s.dtype).scatter_reduce(0, idx, s, "amax")
    n, v, const = torch.stack([count, var, (lo == hi).to(s.dtype)]).index_select(1, idx)
    std = torch.where(n > 1, v.sqrt(), torch.zeros_like(s))
    return GroupStats(idx, n.long(), mean_i, std, const.bool())
