"""What the tasks generated in code share (``hyperrl.data.tasks``' arith / modsum / repeat, ``hyperrl.data.visual``'s
shapes): keyed draws, the first reward reported, no data cursor, and a fixed held-out split; and what every task
declares of its data's lengths (:class:`TaskLimits`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hyperrl.data.parquet import Sample
from hyperrl.tokenizer import encode_prompt

__all__ = ["InCodeTask", "TaskLimits", "held_out_split", "ENCODED_KEPT"]

ENCODED_KEPT = 8192  # distinct prompts whose ids a task keeps (then it starts over)


@dataclass(frozen=True)
class TaskLimits:
    """The token lengths a built task's data needs — what ``task.limits()`` declares, so the run is checked against
    the model's context and the response budget before anything trains (:func:`hyperrl.config.built.check_built`):
    ``response_tokens`` — its longest answer + EOS (0: no answer to fit); ``longest_prompt`` — its longest encoded
    prompt (0: not measured); ``longest_sequence`` — a preference pair's prompt + the longer completion."""

    response_tokens: int = 0
    longest_prompt: int = 0
    longest_sequence: int = 0


class InCodeTask:
    """What the tasks generated in code share: a string prompt, the first reward reported, no cursor
    (their data is a pure function of (seed, step, attempt)). ``response_tokens``: the response budget an exact
    answer needs (0: none declared)."""

    response_tokens = 0

    def limits(self) -> TaskLimits:
        """The answers' budget (:class:`TaskLimits`)."""
        return TaskLimits(response_tokens=self.response_tokens)

    def _rng(self, stream: int, attempt: int = 0) -> np.random.Generator:
        """The generator of one draw: keyed by (seed, stream) — and the refill ``attempt`` when > 0."""
        return np.random.default_rng([self.seed, stream] if attempt == 0 else [self.seed, stream, attempt])

    def encode(self, sample: Sample) -> list[int]:
        """The prompt's ids (:func:`~hyperrl.tokenizer.encode_prompt`), each distinct prompt tokenised once: a task
        drawn in code repeats its prompts (arith's 2,500) — 32 encodings were ≈ 1 ms of a default step."""
        if not isinstance(sample.prompt, str):
            return encode_prompt(self.tokenizer, sample.prompt)
        memo = self.__dict__.setdefault("_encoded", {})
        ids = memo.get(sample.prompt)
        if ids is None:
            if len(memo) >= ENCODED_KEPT:
                memo.clear()
            ids = memo[sample.prompt] = tuple(encode_prompt(self.tokenizer, sample.prompt))
        return list(ids)

    def reward(self, response: str, sample: Sample) -> float:
        """The first reward (what evaluation reports)."""
        return float(self.rewards[0][1](response, sample))

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


def held_out_split(items: list, frac: float, split_seed: int, salt: int) -> tuple[list, list]:
    """A fixed ``frac`` of ``items`` held out by ``split_seed`` (not the run seed: every run evaluates on
    one set): ``(train in the items' order, held out in the draw's order)``."""
    if not 0 < frac < 1:
        raise ValueError(f"task.held_out_frac={frac}: must be in (0, 1)")
    order = np.random.default_rng([split_seed, salt]).permutation(len(items))
    n_eval = max(1, round(frac * len(items)))
    return [items[i] for i in np.sort(order[n_eval:])], [items[i] for i in order[:n_eval]]
