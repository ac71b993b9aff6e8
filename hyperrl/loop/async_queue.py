"""The asynchronous collector's queue: its units, their rows and the requests waiting for a worker, under one lock.

The collector (:class:`~hyperrl.loop.collect_async.AsyncCollector`) coordinates; the workers' threads, the
driver's threads (environment steps, agent rounds) and the learner meet here, each holding ``cond``:

* **admission** (:meth:`AsyncQueue.top_up`) admits what the pure buffer's bound allows (:mod:`.admission`),
  evicted prompts first, and asks the driver for each new unit's first requests (``pending``);
* **delivery** (:meth:`AsyncQueue.deliver`): a worker's finished rows go through the driver to their unit,
  which completes — validated against the workers' contract, or evicted naming the worker — when all its
  rows are in; aborted rows resume (first in line) from their exact partial tokens;
* **consumption** (:meth:`AsyncQueue.take`): the learner's batch, earliest deadline first (or the schedule's
  keys), the draws no live unit can come from forgotten and the conservation law checked;
* :meth:`AsyncQueue.wait` — the learner's (and a pause's) wait, with a deadline on a period without progress.

A unit's key ``k`` is prompt ``k mod P`` of step ``k // P``'s draw (``P = rollout.prompts_per_step``), its
``n`` sample_uids numbered as the synchronous round numbers them, so a resumed or η = 0 run agrees with it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from hyperrl.loop import admission as A
from hyperrl.loop.collect import sample_uid
from hyperrl.rollout.requests import Request, resume_requests
from hyperrl.rollout.workers.base import WorkerError
from hyperrl.trajectory import FINISH_REASONS, TrajectoryError, cat_batches, validate

__all__ = ["AsyncQueue"]

_ABORTED = FINISH_REASONS.index("aborted")


class AsyncQueue:
    """The shared state of an asynchronous run (module doc). ``driver``: the run's
    :class:`~hyperrl.loop.drivers.Driver` (attached by the collector); ``engine``: the one the learner publishes
    to (its pad id, the version it serves); ``workers``: the rollout workers' names; ``log``: the event log
    (None: not recorded), ``fresh``: start it anew (a resumed run appends)."""

    def __init__(self, task, rollout, engine, driver, buffer: A.Buffer, *, workers: list[str], timeout_s: float,
                 log: Path | None, fresh: bool):
        self.cond = threading.Condition()
        self.task, self.rollout, self.engine, self.driver, self.buffer = task, rollout, engine, driver, buffer
        self.workers, self.timeout_s, self.threads = workers, timeout_s, []
        self.version = engine.policy_version  # the learner's version (set by each collect / pause)
        self.pending: list[Request] = []  # requests for the workers (resumed ones first)
        self.units: dict[int, A.Unit] = {}
        self.on_ready = None  # called (under the lock) with a unit's uid, key and validated rows as it is ready
        self.rows: dict[int, list[TensorDict]] = {}  # unit uid → its finished rows
        self.by: dict[int, set[str]] = {}  # unit uid → the workers that delivered its rows
        self.limits: dict[int, int] = {}  # a request's uid → its max_new_tokens (a resumed row lacks it)
        self.draws: dict[int, list] = {}  # step → the task's prompts of that step
        self.requeue: list[int] = []  # keys of evicted units, admitted again first
        self.next_key = 0
        self.errors: dict[str, BaseException] = {}  # a thread's failure, by who failed: the learner raises it
        self.busy: set[str] = set()  # workers generating (or restarting): a pause waits for none
        self.progress = 0  # calls delivered and environment steps taken (a wait's liveness)
        self.paused = self.stopped = False
        self.log, self.seq = log, 0  # every worker call and every take: what a replay needs
        self.timeline: list[dict] = []  # the workers' calls and the evictions since the learner's last take, timed
        if log is not None and fresh:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("")

    def sample(self, key: int):
        """Unit ``key``'s prompt (the task's draw of its step, drawn once)."""
        P = self.rollout.prompts_per_step
        step, g = divmod(key, P)
        if step not in self.draws:
            self.draws[step] = self.task.sample(P, step, attempt=0)
        return self.draws[step][g]

    def uids(self, unit: A.Unit) -> list[int]:
        """The unit's n sample_uids, as the synchronous collector numbers them (step, prompt, sample)."""
        r = self.rollout
        step, g = divmod(unit.key, r.prompts_per_step)
        return [sample_uid(step, 0, g, j, prompts_per_step=r.prompts_per_step, n=r.n,
                           max_generation_batches=r.max_generation_batches) for j in range(r.n)]

    def top_up(self) -> None:
        """(under the lock) Admit what capacity allows: evicted prompts first, then fresh ones."""
        want = self.requeue + list(range(self.next_key, self.next_key + self.buffer.max_concurrent))
        self.buffer, new = A.admit(self.buffer, want, self.version)
        for u in new:
            self.units[u.uid] = u
            self.rows[u.uid], self.by[u.uid] = [], set()
            self.pending.extend(self.driver.open(u))
        keys = {u.key for u in new}
        self.requeue = [k for k in self.requeue if k not in keys]
        self.next_key = max([self.next_key] + [k + 1 for k in keys])
        if new:
            self.cond.notify_all()

    def call(self, schedule) -> tuple[list[Request], int | None, dict]:
        """(under the lock) A worker's call, by ``schedule``: its requests, ``stop_after`` and its log record
        (with the recorded call it replays, if any)."""
        reqs, stop_after, replayed = schedule.take(self)
        self.seq += 1
        record = {"call": self.seq, "version": self.engine.policy_version, "uids": [r.uid for r in reqs]}
        if replayed is not None:
            record["replayed"] = replayed
        return reqs, stop_after, record

    def record(self, event: dict) -> None:
        """(under the lock) Append one event to the run's log (free-running runs)."""
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(event) + "\n")

    def deliver(self, out: TensorDict, worker: str, record: dict, *, t0: float = 0.0, dur: float = 0.0) -> None:
        """A worker's call's rows: finished ones through the driver to their unit (complete when all n are in);
        aborted ones resume, first in line. ``t0`` / ``dur``: when the call started (epoch seconds) and how long it
        ran — the run's timeline."""
        done = out[out["finish_reason"] != _ABORTED]
        with self.cond:
            resumed = resume_requests(out, self.limits)
            record.pop("replayed", None)
            self.record(record)
            self.timeline.append({"call": record["call"], "worker": worker, "version": record["version"],
                                  "requests": len(record["uids"]), "aborted": len(resumed),
                                  "steps": record.get("steps"), "t0": t0, "dur": dur})
            self.progress += 1
            done = self.driver.deliver(done, worker)
            unit_of = {u.key: u.uid for u in self.units.values()}
            for i in range(done.batch_size[0]):
                uid = unit_of[int(done["group_id"][i])]
                self.rows[uid].append(done[i:i + 1])
                self.by[uid].add(worker)
                if len(self.rows[uid]) == self.rollout.n:
                    self.complete(uid)
            self.pending = resumed + self.pending
            self.top_up()
            self.cond.notify_all()

    def complete(self, uid: int) -> None:
        """(under the lock) Unit ``uid``'s rows are all in: validated (versions stamped, its own uids, each once)
        it is ready; rows breaking the contract evict it naming the workers, its prompt admitted again."""
        if not self.rows[uid]:  # agents: every episode failed or never called the model (counted)
            self.buffer = A.complete(self.buffer, uid)
            return
        rows = cat_batches(self.rows[uid], self.engine.pad_id)
        rows = rows[torch.argsort(rows["sample_uid"])]  # the unit's rows in uid order, whichever worker came first
        want = sorted(self.uids(self.units[uid]))
        try:
            validate(rows)
            got = rows["sample_uid"].tolist()
            if self.driver.several_rows and not set(got) <= set(want):  # an agent's episode may leave several rows
                raise TrajectoryError(f"sample_uid: {sorted(set(got) - set(want))} are not this group's {want}")
            if not self.driver.several_rows and sorted(got) != want:
                raise TrajectoryError(f"sample_uid: {sorted(got)}, expected {want}")
            self.rows[uid] = [rows]
            self.buffer = A.complete(self.buffer, uid)
            if self.on_ready is not None:  # e.g. its scoring starts now, while the rest is generated
                self.on_ready(uid, self.units[uid].key, rows)
        except TrajectoryError as e:
            self.buffer = A.evict(self.buffer, uid, f"{', '.join(sorted(self.by[uid]))}: {e}")
            self.timeline.append({"evict": self.units[uid].key, "why": str(e), "t0": time.time()})
            self.requeue.append(self.units.pop(uid).key)
            self.rows.pop(uid)
            self.by.pop(uid)

    def take(self, keys: list | None) -> list[A.Unit] | None:
        """(under the lock) The batch's units at the learner's version — earliest deadline first, or the
        schedule's ``keys`` — or None while they are not ready."""
        self.buffer, got = A.take_batch(self.buffer, self.version) if keys is None else \
            A.take_units(self.buffer, keys)
        return got

    def consume(self, step: int, taken: list[A.Unit]) -> list[TensorDict]:
        """(under the lock) Step ``step``'s taken units' rows (the take recorded); the units forgotten with the
        draws no live, re-admittable or future unit can come from; the conservation law checked."""
        self.record({"take": step, "keys": [u.key for u in taken]})
        rows = [r for u in taken for r in self.rows.pop(u.uid)]
        for u in taken:
            self.units.pop(u.uid)
            self.by.pop(u.uid)
        low = min([u.key for u in self.buffer.units] + self.requeue + [self.next_key]) // self.rollout.prompts_per_step
        for step in [s for s in self.draws if s < low]:
            del self.draws[step]
        A.check_conservation(self.buffer)
        return rows

    def fail(self, who: str, e: BaseException) -> None:
        """(under the lock) ``who`` failed with ``e``: the learner's next wait raises it."""
        self.errors[who] = e
        self.cond.notify_all()

    def notify(self) -> None:
        """Wake every waiter (a parked worker's signal)."""
        with self.cond:
            self.cond.notify_all()

    def _check(self) -> None:
        for who, e in self.errors.items():
            if isinstance(e, WorkerError):
                raise WorkerError(str(e)) from e
            if who.startswith("environment"):
                raise WorkerError(f"{who}: {e}") from e
            raise WorkerError(f"{who} died: {type(e).__name__}: {e}") from e
        for t in self.threads:
            if not t.is_alive():
                raise WorkerError(f"{t.name} is not running")

    def wait(self, pred, what: str) -> None:
        """Wait (under the lock) for ``pred``; ``timeout_s`` bounds a period without progress (no group
        finished or started), not the whole wait — a large batch that keeps arriving never times out,
        a dead or stuck worker is an error."""
        deadline = time.monotonic() + self.timeout_s
        seen = (self.buffer.ready, self.buffer.in_flight, self.progress)
        while not pred():
            self._check()
            now = (self.buffer.ready, self.buffer.in_flight, self.progress)
            if now != seen:  # progress: the deadline starts again
                seen, deadline = now, time.monotonic() + self.timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                who = ", ".join(sorted(self.busy)) or ", ".join(self.workers)
                raise WorkerError(f"{who}: no progress in {self.timeout_s:g} s while {what} "
                                  f"(in flight {self.buffer.in_flight}, ready {self.buffer.ready}); still serving "
                                  f"version {self.engine.policy_version}")
            self.cond.wait(min(left, 1.0))

    def state(self) -> dict:
        """(under the lock) The prompts of every live unit (in admission order) and of evicted-not-yet-readmitted
        ones, the data cursor and the counters; and the ready units an older version than the learner's generated,
        with their rows (``ready``: the weights a resume has cannot generate them again) — :meth:`AsyncCollector.state
        <hyperrl.loop.collect_async.AsyncCollector.state>`."""
        b = self.buffer
        kept = [u for u in b.units if u.state == A.READY and u.version < self.version]
        ready = [{"key": u.key, "version": u.version,
                  "rows": {k: v for k, v in self.rows[u.uid][0].items()} if self.rows[u.uid] else {}} for u in kept]
        return {"live": [u.key for u in b.units] + list(self.requeue), "next_key": self.next_key,
                "consumed": b.consumed, "evicted": b.evicted, "evictions": [list(e) for e in b.evictions],
                "ready": ready}

    def load_state(self, st: dict) -> None:
        """(under the lock) A checkpoint's :meth:`state`: its ready units are ready again, with their rows and
        admission versions (their scoring starts again); its other prompts are admitted again first; the units in
        flight are forgotten (the driver's too: their episodes start again)."""
        b = self.buffer
        ready = st.get("ready", [])  # a checkpoint from before ready rows were kept: every prompt regenerated
        base = st["consumed"] + st["evicted"]
        units = tuple(A.Unit(base + i, r["version"], r["key"], A.READY) for i, r in enumerate(ready))
        self.buffer = A.Buffer(b.eta, b.batch, b.max_concurrent, units, base + len(units), st["consumed"],
                               st["evicted"], tuple(tuple(e) for e in st["evictions"]))
        self.units, self.rows, self.by, self.pending, self.limits = {}, {}, {}, [], {}
        self.driver.reset()
        for u, r in zip(units, ready):
            rows = r["rows"]
            self.units[u.uid], self.by[u.uid] = u, set()
            self.rows[u.uid] = [TensorDict(rows, batch_size=[rows["tokens"].shape[0]])] if rows else []
            if rows and self.on_ready is not None:
                self.on_ready(u.uid, u.key, self.rows[u.uid][0])
        kept = {u.key for u in units}
        self.requeue, self.next_key = [k for k in st["live"] if k not in kept], st["next_key"]
        self.record({"resume": st.get("step", None)})
