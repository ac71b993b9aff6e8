"""Running reward statistics as an optax-style ``(init, update)`` pair with frozen state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RunningStats", "running_stats_init", "running_stats_update", "running_stats_normalize"]


@dataclass(frozen=True)
class RunningStats:
    """Frozen running mean / variance: ``count``, ``mean`` and ``m2``; ``var = m2 / (count − 1)`` (0 for ≤ 1)."""

    count: float  # samples seen
    mean: float
    m2: float  # Σ (x − mean)², merged with Chan et al.'s parallel formula

    @property
    def var(self) -> float:
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0


def running_stats_init() -> RunningStats:
    """An empty running mean / variance (count, mean, M2 all 0)."""
    return RunningStats(0.0, 0.0, 0.0)


def running_stats_update(state: RunningStats, x: torch.Tensor) -> RunningStats:
    """Merge a batch ``x`` (any shape) into the state (Chan et al. 1979); returns a new state."""
    x = x.detach().double().flatten()
    n_b = x.numel()
    if n_b == 0:
        return state
    mean_b = float(x.mean())
    m2_b = float(((x - mean_b) ** 2).sum())
    n = state.count + n_b
    delta = mean_b - state.mean
    return RunningStats(n, state.mean + delta * n_b / n, state.m2 + m2_b + delta**2 * state.count * n_b / n)


def running_stats_normalize(state: RunningStats, x: torch.Tensor, *, eps: float = 1e-8, center: bool = True):
    """``(x − mean)/(std + eps)`` with the running statistics (``center=False`` only scales)."""
    y = x - state.mean if center else x
    return y / (state.var**0.5 + eps)
