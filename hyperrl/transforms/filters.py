"""Batch filters returning index/keep masks (pure; the caller refills)."""

from __future__ import annotations

import torch

from hyperrl.registry import Registry
from hyperrl.transforms.groups import group_stats

__all__ = ["FILTERS", "register_filter", "informative_groups", "dynamic_sampling_filter"]

# A filter is ``(batch, **hyperparams) -> (kept batch, dropped count)``; the loop refills the batch.
FILTERS: Registry = Registry("batch filter")
register_filter = FILTERS.register


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Keep-mask ``[B]``: samples whose group's rewards are not all exactly equal (std > 0)."""
    return ~group_stats(scores, group_ids).constant


@register_filter("dynamic_sampling", needs=("reward", "group_id"))
def dynamic_sampling_filter(batch, *, key: str = "reward"):
    """DAPO dynamic sampling: drop groups whose rewards are all equal. Returns a *new* batch and
    the number of dropped sequences (the caller samples more prompts to refill)."""
    keep = informative_groups(batch[key], batch["group_id"])
    return batch[keep], int((~keep).sum())
