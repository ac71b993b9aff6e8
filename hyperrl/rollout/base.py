"""The rollout-engine protocol shared by every engine (transformers on CPU, vLLM).

``generate(prompts, sampling, n)`` takes prompts as **token-id lists** (token-first: the ids the
engine samples from are the ids the trainer trains on) and returns a validated trajectory batch:
prompt + response ids right-padded, fp32 log-probs of the sampled tokens, the action mask (the
generated tokens, including the EOS the policy sampled), the serving ``policy_version`` and group
ids (the ``n`` samples of prompt ``i`` share ``group_offset + i``).

``load_weights(weights, version)`` is one versioned transaction: every tensor is received and
checked (names, shapes, dtypes, finite values, complete set) before any is applied, so a failure
mid-publication leaves version ``V`` serving, never a mix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from ..sampling import SamplingParams

__all__ = ["SamplingParams", "RolloutEngine", "WeightPublishError", "stage_weights"]


class WeightPublishError(RuntimeError):
    """A publication was refused or failed; the engine still serves the previous version."""


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def policy_version(self) -> int: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1, *,
                 group_offset: int = 0) -> TensorDict: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None: ...


def stage_weights(weights, expected: Mapping[str, torch.Tensor], version: int, current: int, *,
                  partial: bool = False, aliases: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Receive and check a whole publication before anything is applied (see module doc).
    ``aliases`` (``alias → canonical``, e.g. a tied ``lm_head.weight``) are filled from their
    canonical tensor when the publisher sends only one name."""
    if version <= current:
        raise WeightPublishError(f"version {version}: must be greater than the serving version {current}")
    items = weights.items() if isinstance(weights, Mapping) else weights
    staged: dict[str, torch.Tensor] = {}
    try:
        for name, t in items:
            staged[name] = t
    except Exception as e:  # noqa: BLE001 - the publisher failed mid-way: nothing is applied
        raise WeightPublishError(f"publication of version {version} failed after {len(staged)} tensors: {e!r}; "
                                 f"still serving version {current}") from e
    for alias, canon in (aliases or {}).items():
        if alias not in staged and canon in staged:
            staged[alias] = staged[canon]
    unknown = sorted(set(staged) - set(expected))
    if unknown:
        raise WeightPublishError(f"unknown parameters {unknown[:5]} (still serving version {current})")
    missing = sorted(set(expected) - set(staged))
    if missing and not partial:
        raise WeightPublishError(f"incomplete publication: missing {missing[:5]}{' …' if len(missing) > 5 else ''} "
                                 f"({len(missing)} in all); still serving version {current}")
    for name, t in staged.items():
        want = expected[name]
        if tuple(t.shape) != tuple(want.shape):
            raise WeightPublishError(f"{name}: shape {list(t.shape)}, engine has {list(want.shape)}")
        if not torch.isfinite(t).all():
            raise WeightPublishError(f"{name}: contains NaN/inf; refusing version {version}")
    return staged
