"""Sampling parameters: neutral ground shared by rollout engines and environments (neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` > 0; ``top_k`` 0 = off; ``top_p`` 1 = off; generation stops at ``eos_id``
    (or any of ``stop_ids``, e.g. a chat model's end-of-turn token) or after ``max_new_tokens``.
    ``seed`` makes sampling reproducible."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_id: int | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()

    @property
    def stops(self) -> tuple[int, ...]:
        """Every id that ends a response (``eos_id`` first)."""
        head = () if self.eos_id is None else (self.eos_id,)
        return head + tuple(i for i in self.stop_ids if i != self.eos_id)

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 (RL needs the sampled distribution)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be ≥ 0 (0 disables it)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be ≥ 1")
