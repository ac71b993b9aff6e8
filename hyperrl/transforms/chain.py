"""Composition: a chain of batch transforms is itself a transform."""

from __future__ import annotations

import functools
from collections.abc import Callable

from tensordict import TensorDict

__all__ = ["chain", "bind"]

Transform = Callable[[TensorDict], TensorDict]


def bind(fn: Callable, /, **kwargs) -> Transform:
    """Fix keyword arguments: ``bind(compute_advantages, estimator="rloo")`` is a transform."""
    return functools.partial(fn, **kwargs)


def chain(*transforms: Transform) -> Transform:
    """``chain(f, g, h)(batch) == h(g(f(batch)))``; each stage must return a TensorDict."""
    for i, t in enumerate(transforms):
        if not callable(t):
            raise TypeError(f"chain: stage {i} ({t!r}) is not callable")

    def chained(batch: TensorDict) -> TensorDict:
        for i, t in enumerate(transforms):
            batch = t(batch)
            if not isinstance(batch, TensorDict):
                raise TypeError(f"chain: stage {i} ({getattr(t, '__name__', t)}) returned {type(batch).__name__}")
        return batch

    chained.stages = transforms
    return chained
