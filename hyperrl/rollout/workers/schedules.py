"""The asynchronous collector's schedules: how rollout workers take requests, and what a pause
(before a publication or an evaluation) waits for. Small objects, one per mode (``async.schedule``), each
declaring what it does (``interrupts``, ``records``, ``whole_steps``: read by the config's checks at load), called by
:class:`~hyperrl.loop.collect_async.AsyncCollector` under the lock of its queue (``q``, an
:class:`~hyperrl.loop.async_queue.AsyncQueue`):

* :class:`FreeSchedule` (``async.schedule: free``) — each call takes an even share of what waits;
  a pause interrupts running generations (their rows resume from their exact partial tokens);
  every call and take is recorded in the run's event log;
* :class:`GatedSchedule` (``gated``) — each call takes the next fixed chunk of the earliest step,
  and a pause first waits until every admitted request is generated, so batch k comes whole from
  version ``max(0, k − η)``: the same run every time, without a log;
* :class:`ReplaySchedule` (``async.replay``) — the recorded run's calls, in its order, each
  stopping at the decode step where the recorded one was interrupted, and its takes.

Whether a pause interrupts or parks generations over their kept KV cache (``async.kv_cache``) is
the collector's, orthogonal to the schedule.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from hyperrl.registry import Registry
from hyperrl.rollout.workers.base import LIVE

__all__ = ["ASYNC_SCHEDULES", "Schedule", "FreeSchedule", "GatedSchedule", "ReplaySchedule", "EventLog",
           "read_event_log", "make_schedule"]

ASYNC_SCHEDULES: Registry = Registry("async schedule")  # async.schedule (a Literal of the config: checked at load)


@dataclass
class EventLog:
    """A recorded free-running run: its worker calls (in the order they started) and its takes."""

    calls: list[dict]
    takes: dict[int, list]


def read_event_log(path) -> EventLog:
    """``async_events.jsonl`` of a free-running run → the calls to make and the batches to take."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"async.replay: {p} does not exist (a free-running run writes out_dir/async_events.jsonl)")
    calls, takes = [], {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        e = json.loads(line)
        if "resume" in e:
            raise ValueError(f"async.replay: {p}:{n}: the recorded run was resumed from a checkpoint; only a run "
                             "recorded from its start replays")
        if "call" in e:
            calls.append(e)
        elif "take" in e:
            takes[e["take"]] = e["keys"]
    return EventLog(sorted(calls, key=lambda e: e["call"]), takes)


class Schedule(ABC):
    """The base: a call may start whenever requests wait. ``interrupts``: a pause interrupts running
    generations (and may park them over their kept KV cache instead: ``async.kv_cache``); ``records``: the run's
    event log is written (what ``async.replay`` reads); ``whole_steps``: batch k is generated whole at one version
    (admission by whole steps; multi-turn turns in lockstep) — reproducible without a log."""

    name = ""
    interrupts = False
    records = False
    whole_steps = False

    def can_take(self, q) -> bool:
        """Is there a call for a worker to make now?"""
        return bool(q.pending)

    @abstractmethod
    def take(self, q) -> tuple[list, int, dict | None]:
        """A worker's call: its requests (removed from ``q.pending``), ``stop_after``, and the
        recorded call it replays (None)."""

    def drain(self, q, what: str, drain: bool) -> None:
        """What a pause waits for before the workers stop taking calls (nothing here)."""
        return None  # a default hook: nothing to do

    def batch_keys(self, step: int) -> list | None:
        """The unit keys to take at ``step`` (None: earliest deadline first)."""
        return None

    def died(self, replayed: dict | None) -> None:
        """A worker died mid-call: its requests wait again (the collector's); here, nothing more."""
        return None  # a default hook: nothing to do


@ASYNC_SCHEDULES.register("free")
class FreeSchedule(Schedule):
    """Workers run ahead within η; each call takes ⌈waiting / workers⌉ requests; a pause interrupts."""

    name, interrupts, records = "free", True, True

    def take(self, q):
        k = math.ceil(len(q.pending) / len(q.workers))
        reqs, q.pending = q.pending[:k], q.pending[k:]
        return reqs, LIVE, None


@ASYNC_SCHEDULES.register("gated")
class GatedSchedule(Schedule):
    """Batch k generated whole at version ``max(0, k − η)``: a call takes the next fixed chunk of the
    earliest step (⌈P·n / workers⌉ requests) — the same calls, with the same rows, in every run —
    and a pause waits until every admitted request is generated."""

    name, whole_steps = "gated", True

    def take(self, q):
        r = q.rollout
        step = q.pending[0].group_id // r.prompts_per_step
        same = sum(1 for x in q.pending if x.group_id // r.prompts_per_step == step)
        k = min(same, math.ceil(r.prompts_per_step * r.n / len(q.workers)))
        reqs, q.pending = q.pending[:k], q.pending[k:]
        return reqs, LIVE, None

    def drain(self, q, what: str, drain: bool) -> None:
        q.wait(lambda: q.buffer.in_flight == 0 and not q.busy, what)


class ReplaySchedule(Schedule):
    """A recorded free-running run again, bit for bit: its calls in order — each once its requests
    wait and the engine serves its version, stopping after the recorded decode steps — and its takes;
    a pause before a publication (``drain``) first runs the log's calls at this version."""

    name = "replay"

    def __init__(self, log: EventLog):
        self.log = log

    def can_take(self, q) -> bool:
        calls = self.log.calls
        if not calls or calls[0]["version"] != q.engine.policy_version:
            return False
        waiting = {x.uid for x in q.pending}
        return all(u in waiting for u in calls[0]["uids"])

    def take(self, q):
        call = self.log.calls.pop(0)
        by_uid = {x.uid: x for x in q.pending}
        reqs = [by_uid[u] for u in call["uids"]]
        taken = set(call["uids"])
        q.pending = [x for x in q.pending if x.uid not in taken]
        return reqs, call["steps"], call

    def drain(self, q, what: str, drain: bool) -> None:
        if drain:
            calls = self.log.calls
            q.wait(lambda: not q.busy and (not calls or calls[0]["version"] > q.version), what)

    def batch_keys(self, step: int) -> list:
        if step not in self.log.takes:
            raise ValueError(f"async.replay: the event log ends before step {step} (it has {len(self.log.takes)} "
                             "steps)")
        return self.log.takes[step]

    def died(self, replayed: dict | None) -> None:
        self.log.calls.insert(0, replayed)  # the call runs again, whole


def make_schedule(schedule: str, replay: str | None) -> Schedule:
    """The schedule of the ``async`` section: the replay of ``replay``'s event log when set (of a
    free-running run), else ``ASYNC_SCHEDULES[schedule]``."""
    if replay is not None:
        return ReplaySchedule(read_event_log(replay))
    return ASYNC_SCHEDULES.get(schedule)()
