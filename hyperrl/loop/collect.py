"""Collectors: how a step's batch is gathered — the seam between generation and learning.

A :class:`Collector` has ``collect(step, version, timer) -> Collected`` (this rank's rewarded,
shaped batch, its metrics and the step's prompts by group id),
``paused(what, drain=True)`` — a context the trainer publishes and evaluates in —, ``state()`` /
``load_state(state)`` (what a checkpoint adds), and ``close()``. :class:`SyncCollector` generates
on demand; :class:`hyperrl.loop.collect_async.AsyncCollector` takes batches from rollout workers
that run ahead within the staleness bound. Both score and shape through the same
:func:`score_and_shape`, so the two cannot drift.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.trajectory import cat_batches

__all__ = ["Collector", "Collected", "SyncCollector", "Timer", "sample_uid", "score_and_shape"]


@dataclass(frozen=True)
class Collected:
    """What a collector hands the trainer for one step: this rank's ``batch`` (rewarded, shaped), its ``metrics``
    (the collector's own: filter rounds, agent counts, the async buffer) and the step's prompts by group id
    (``samples``: what a key provider that re-rolls a prompt reads — ReMax's baseline, a row's data source)."""

    batch: TensorDict
    metrics: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # the collector's timeline since the last step (workers' calls, …)


class Timer:
    """Wall-clock phases of a step: ``with timer("generate"): …`` adds to ``timer.t["time_generate_s"]`` and
    appends ``(name, start, seconds)`` to ``timer.spans`` (start: seconds since the epoch — a timeline's)."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        wall, t0 = time.time(), time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.t[f"time_{name}_s"] = self.t.get(f"time_{name}_s", 0.0) + dt
            self.spans.append((name, wall, dt))


def sample_uid(step: int, attempt: int, prompt: int, sample: int, *, prompts_per_step: int, n: int,
               max_generation_batches: int) -> int:
    """The ``sample_uid`` of sample ``sample`` of global prompt ``prompt`` in generation round
    ``attempt`` of ``step``: unique over the run and a pure function of those — resume needs no state."""
    return ((step * max_generation_batches + attempt) * prompts_per_step + prompt) * n + sample


def score_and_shape(batch: TensorDict, samples, scorer, pipeline, ready=None) -> TensorDict:
    """Rewards (:class:`~hyperrl.loop.scoring.Scorer`; ``ready``: the rows' scorings already started), then the
    pipeline's reward shaping; what shaping changed in ``reward`` lands on the last action token of
    ``token_rewards`` (when the run has them), so the per-token credit still sums to the shaped reward."""
    batch = pipeline.shape(scorer.score(batch, samples, ready))
    if "token_rewards" in batch.keys():
        tr = batch["token_rewards"]
        batch = batch.copy().set("token_rewards", tr + T.scores_to_token_rewards(
            batch["reward"] - tr.sum(-1), batch["action_mask"]))
    return batch


@runtime_checkable
class Collector(Protocol):
    """How a step's batch is gathered (see the module doc)."""

    def collect(self, step: int, version: int, timer: Timer) -> Collected: ...

    def paused(self, what: str, *, drain: bool = True) -> contextlib.AbstractContextManager: ...

    def state(self) -> dict: ...

    def load_state(self, state: dict) -> None: ...

    def close(self) -> None: ...


class SyncCollector:
    """Generate this rank's share of ``rollout.prompts_per_step`` groups now, score and shape them.
    With a group filter the batch is refilled — up to ``rollout.max_generation_batches`` rounds,
    fresh prompts each round — until it holds the share's number of informative groups; the counts
    are reported (``filter_*``)."""

    def __init__(self, generator, scorer, pipeline, task, parallel, rollout):
        self.generator, self.scorer, self.pipeline, self.task = generator, scorer, pipeline, task
        self.parallel, self.rollout = parallel, rollout

    def _uids(self, step: int, attempt: int) -> list[int]:
        r = self.rollout
        return [sample_uid(step, attempt, g, j, prompts_per_step=r.prompts_per_step, n=r.n,
                           max_generation_batches=r.max_generation_batches)
                for g in self.parallel.shard(list(range(r.prompts_per_step))) for j in range(r.n)]

    def collect(self, step: int, version: int, timer: Timer) -> Collected:
        """Step ``step``'s batch (generated now from the served ``version``)."""
        r, p = self.rollout, self.pipeline
        want = len(self.parallel.shard(list(range(r.prompts_per_step))))
        kept, n_groups, dropped, rounds, samples = [], 0, 0, 0, {}
        self.generator.pop_stats()  # an evaluation's agent counts are not this step's
        for attempt in range(r.max_generation_batches if p.filter else 1):
            drawn = self.parallel.shard(self.task.sample(r.prompts_per_step, step, attempt=attempt))
            offset = len(samples)
            samples.update({offset + i: s for i, s in enumerate(drawn)})
            with timer("generate"):
                batch = self.generator.generate(drawn, self.generator.sampling(step, 10**7 * attempt), r.n, offset,
                                                uids=self._uids(step, attempt), step=step)
            with timer("reward"):
                batch = score_and_shape(batch, samples, self.scorer, p)
            rounds += 1
            if p.filter is None:
                kept.append(batch)
                break
            batch, d = p.filter(batch)
            dropped += d // r.n
            kept.append(batch)
            n_groups += int(torch.unique(batch["group_id"]).numel()) if batch.batch_size[0] else 0
            if n_groups >= want:
                break
        batch = cat_batches(kept)
        if p.filter is not None and n_groups > want:  # exactly the share: the first `want` groups generated
            batch = batch[torch.isin(batch["group_id"], torch.unique(batch["group_id"])[:want])]
        info = {"filter_rounds": rounds, "filter_dropped_groups": dropped, "filter_kept_groups": min(n_groups, want)}
        return Collected(batch, {**(info if p.filter is not None else {}), **self.generator.pop_stats()}, samples)

    @contextmanager
    def paused(self, what: str, *, drain: bool = True) -> Iterator[None]:
        """Nothing runs between steps: nothing to pause."""
        yield

    def state(self) -> dict:
        """A synchronous run's collector keeps nothing between steps."""
        return {}

    def load_state(self, state: dict) -> None:
        """A checkpoint of an asynchronous run carries its buffer: resume it asynchronously."""
        if "async" in state:
            raise ValueError("resume: the checkpoint was written by an asynchronous run (async.max_staleness set); "
                             "resume it with the same async.max_staleness or start a new out_dir")

    def close(self) -> None:
        """Nothing to release."""
