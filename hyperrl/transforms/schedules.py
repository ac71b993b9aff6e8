"""Learning-rate schedules: pure functions of the optimizer-step index.

A schedule is ``multiplier(k, total) → m ∈ [min_ratio, 1]`` (registry ``LR_SCHEDULES``); the
trainer sets ``lr = base_lr · m`` before optimizer step ``k`` (0-based, counted over the whole
run). Its only state is ``k``, which the checkpoint records, so a resumed run continues the same
curve. Linear warmup is a separate wrapper (:func:`lr_multiplier`):

* warmup: ``m = (k + 1) / W`` for ``k < W`` (never 0 — the first step already moves);
* ``constant``: ``m = 1``;
* ``linear``: ``m = 1 − (1 − r)·p``;
* ``cosine``: ``m = r + (1 − r)·(1 + cos(π p)) / 2`` (Loshchilov & Hutter, 2017),

with ``p = (k − W) / max(total − W − 1, 1)`` clipped to [0, 1] and ``r`` = ``min_ratio``.
These are the shapes of transformers' ``get_{constant,linear,cosine}_schedule_with_warmup``
except that hyperrl decays to ``min_ratio`` (verl's ``min_lr_ratio``) and reaches it at the last step.
"""

from __future__ import annotations

import math

from hyperrl.registry import Registry

__all__ = ["LR_SCHEDULES", "lr_multiplier"]

LR_SCHEDULES: Registry = Registry("lr schedule")


@LR_SCHEDULES.register("constant")
def constant(p: float, min_ratio: float) -> float:
    """``m = 1`` whatever the progress ``p`` (``min_ratio`` is ignored)."""
    return 1.0


@LR_SCHEDULES.register("linear")
def linear(p: float, min_ratio: float) -> float:
    """``m = 1 − (1 − r)·p``, ``r`` = ``min_ratio``: from 1 at progress ``p = 0`` down to ``r`` at ``p = 1``."""
    return 1.0 - (1.0 - min_ratio) * p


@LR_SCHEDULES.register("cosine")
def cosine(p: float, min_ratio: float) -> float:
    """``m = r + (1 − r)·(1 + cos(π p)) / 2`` (Loshchilov & Hutter, 2017): from 1 at ``p = 0`` to ``r`` at ``p = 1``."""
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def lr_multiplier(k: int, *, schedule: str = "constant", total: int, warmup: int = 0,
                  min_ratio: float = 0.0) -> float:
    """The multiplier of the base learning rate at optimizer step ``k`` of ``total``."""
    if k < 0 or total < 1:
        raise ValueError(f"step {k} of total {total}: need 0 ≤ step and total ≥ 1")
    if warmup < 0 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"warmup={warmup}, min_ratio={min_ratio}: need warmup ≥ 0 and 0 ≤ min_ratio ≤ 1")
    fn = LR_SCHEDULES.get(schedule)
    if k < warmup:
        return (k + 1) / warmup
    p = min(max((k - warmup) / max(total - warmup - 1, 1), 0.0), 1.0)
    return fn(p, min_ratio)
