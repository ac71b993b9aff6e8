"""Tasks: where prompts, answers and rewards come from, one registry (``TASKS``) of factories
``(tokenizer, seed, **hyperparams) -> task``.

A task has ``sample(k, step)``, ``held_out(k)``, ``encode(sample) -> ids``, ``rewards`` (named
reward functions ``(response, sample) -> float``; several fill ``reward_components`` ``[B, K]``),
``state()`` / ``load_state()`` (its data cursor, for resume).

``modsum`` (the embedded default, generated in code): prompt ``"a+b="`` with digits ``a, b``;
the answer is ``(a + b) mod m``; reward 1 when the first generated character is the answer
digit. A random policy over the ~90-token vocabulary scores ≈ 0.01–0.02; the task allows partial
progress (first learn to emit digits, then the right one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .data import PromptDataset, PromptLoader, Sample, render_chat
from .envs.rewards import REWARDS, RewardName
from .registry import Registry

__all__ = ["TASKS", "register_task", "ModSumTask", "ParquetTask", "make_task"]

TASKS: Registry = Registry("task")
register_task = TASKS.register


def _reward_fns(names, where: str) -> tuple:
    if isinstance(names, str):
        names = (names,)
    if not names:
        raise ValueError(f"{where}: a task needs at least one reward")
    return tuple((n, REWARDS.get(n)) for n in names)


@dataclass
class ModSumTask:
    tokenizer: object
    modulus: int = 10
    max_operand: int = 9
    seed: int = 0
    rewards: tuple = field(default_factory=lambda: _reward_fns(("first_char_exact",), "task.rewards"))

    def _draw(self, k: int, stream: int, attempt: int = 0) -> list[Sample]:
        key = [self.seed, stream] if attempt == 0 else [self.seed, stream, attempt]
        ab = np.random.default_rng(key).integers(0, self.max_operand + 1, size=(k, 2))
        return [Sample(f"{a}+{b}=", str((a + b) % self.modulus), f"modsum:{a}+{b}", {}) for a, b in ab.tolist()]

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """``k`` prompts for ``step`` — a pure function of (seed, step, attempt), so resumed runs see
        the same data; ``attempt`` > 0 draws fresh prompts for a refill round."""
        return self._draw(k, step, attempt)

    def held_out(self, k: int) -> list[Sample]:
        return self._draw(k, 10**9)

    def encode(self, sample: Sample) -> list[int]:
        return self.tokenizer.encode(sample.prompt, bos=True)

    def reward(self, response: str, sample: Sample) -> float:
        """The first reward (what evaluation reports)."""
        return float(self.rewards[0][1](response, sample))

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class ParquetTask:
    """Prompts from a parquet dataset (resumable cursor), rewards from the ``REWARDS`` registry."""

    def __init__(self, tokenizer, path: str, rewards=("gsm8k_exact",), *, seed: int = 0, batch_size: int = 1):
        self.tokenizer = tokenizer
        self.dataset = PromptDataset.from_parquet(path)
        self.loader = PromptLoader(self.dataset, batch_size, seed=seed)
        self.rewards = _reward_fns(rewards, "task.rewards")

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """The next ``k`` rows of the resumable cursor (refill rounds read on)."""
        return self.loader.next_batch(k)

    def held_out(self, k: int) -> list[Sample]:
        return [self.dataset[i % len(self.dataset)] for i in range(k)]

    def encode(self, sample: Sample) -> list[int]:
        text = sample.prompt if isinstance(sample.prompt, str) else render_chat(sample.prompt)
        return self.tokenizer.encode(text, bos=True)

    def reward(self, response: str, sample: Sample) -> float:
        return float(self.rewards[0][1](response, sample))

    def state(self) -> dict:
        from dataclasses import asdict

        return {"cursor": asdict(self.loader.state)}

    def load_state(self, state: dict) -> None:
        from .data import CursorState

        if "cursor" in state:
            self.loader.state = CursorState(**state["cursor"])


@register_task("modsum", produces=("reward",))
def modsum(tokenizer, seed: int, *, modulus: int = 10, max_operand: int = 9,
           rewards: tuple[RewardName, ...] = ("first_char_exact",)) -> ModSumTask:
    """``(a + b) mod modulus`` with operands ``0..max_operand``, generated in code (single-digit answers)."""
    if not 2 <= modulus <= 10:
        raise ValueError(f"task.modulus={modulus}: answers must be single digits (2 ≤ modulus ≤ 10)")
    return ModSumTask(tokenizer, modulus, max_operand, seed, _reward_fns(rewards, "task.rewards"))


@register_task("parquet", produces=("reward",))
def parquet(tokenizer, seed: int, *, path: str, rewards: tuple[RewardName, ...] = ("gsm8k_exact",)) -> ParquetTask:
    """Prompts from a verl-style parquet file (``prompt``, ``reward_model.ground_truth`` …)."""
    return ParquetTask(tokenizer, path, rewards, seed=seed)


def make_task(spec, tokenizer, seed: int):
    """Build the task a config section ``{name, **hyperparams}`` names (see :mod:`hyperrl.config`)."""
    return TASKS.build(spec.name, **spec.args)(tokenizer, seed)
