"""Tasks: where prompts, answers and rewards come from.

``modsum`` (the embedded default, generated in code): prompt ``"a+b="`` with digits ``a, b``;
the answer is ``(a + b) mod m``; reward 1 when the first generated character is the answer
digit. A random policy over the ~90-token vocabulary scores ≈ 0.01–0.02; the task allows partial
progress (first learn to emit digits, then the right one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import PromptDataset, PromptLoader, Sample, render_chat
from .envs.rewards import REWARDS
from .tokenizer import CharTokenizer

__all__ = ["ModSumTask", "ParquetTask", "make_task"]


@dataclass
class ModSumTask:
    tokenizer: CharTokenizer
    modulus: int = 10
    max_operand: int = 9
    seed: int = 0

    def _draw(self, k: int, stream: int) -> list[Sample]:
        ab = np.random.default_rng([self.seed, stream]).integers(0, self.max_operand + 1, size=(k, 2))
        return [Sample(f"{a}+{b}=", str((a + b) % self.modulus), f"modsum:{a}+{b}", {}) for a, b in ab.tolist()]

    def sample(self, k: int, step: int) -> list[Sample]:
        """``k`` prompts for ``step`` — a pure function of (seed, step), so resumed runs see the same data."""
        return self._draw(k, step)

    def held_out(self, k: int) -> list[Sample]:
        return self._draw(k, 10**9)

    def encode(self, sample: Sample) -> list[int]:
        return self.tokenizer.encode(sample.prompt, bos=True)

    def reward(self, response: str, sample: Sample) -> float:
        return float(response[:1] == sample.answer)

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class ParquetTask:
    """Prompts from a parquet dataset (resumable cursor), reward from the ``REWARDS`` registry."""

    def __init__(self, tokenizer, path: str, reward: str, *, seed: int = 0, batch_size: int = 1):
        self.tokenizer = tokenizer
        self.dataset = PromptDataset.from_parquet(path)
        self.loader = PromptLoader(self.dataset, batch_size, seed=seed)
        self.reward_fn = REWARDS.get(reward)

    def sample(self, k: int, step: int) -> list[Sample]:
        return self.loader.next_batch(k)

    def held_out(self, k: int) -> list[Sample]:
        return [self.dataset[i % len(self.dataset)] for i in range(k)]

    def encode(self, sample: Sample) -> list[int]:
        text = sample.prompt if isinstance(sample.prompt, str) else render_chat(sample.prompt)
        return self.tokenizer.encode(text, bos=True)

    def reward(self, response: str, sample: Sample) -> float:
        return float(self.reward_fn(response, sample))

    def state(self) -> dict:
        from dataclasses import asdict

        return {"cursor": asdict(self.loader.state)}

    def load_state(self, state: dict) -> None:
        from .data import CursorState

        if "cursor" in state:
            self.loader.state = CursorState(**state["cursor"])


def make_task(cfg, tokenizer, seed: int):
    if cfg.name == "modsum":
        if cfg.modulus > 10:
            raise ValueError(f"task.modulus={cfg.modulus}: answers must be single digits (≤ 10)")
        return ModSumTask(tokenizer, cfg.modulus, cfg.max_operand, seed)
    if cfg.name == "parquet":
        if not cfg.parquet:
            raise ValueError("task.parquet: set the parquet file for task.name=parquet")
        return ParquetTask(tokenizer, cfg.parquet, cfg.reward, seed=seed)
    raise ValueError(f"task.name={cfg.name!r}; choose 'modsum' or 'parquet'")
