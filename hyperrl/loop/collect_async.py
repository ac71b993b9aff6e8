"""The asynchronous collector: rollout and learning overlap, every trained token at most η versions stale.

Rollout workers (``async.executor``: a thread of this process driving the run's engine, or Ray
actors each holding a copy — :mod:`hyperrl.rollout.workers`) generate admitted requests while the
learner trains on earlier ones, one driver thread per worker. The pure pieces decide everything
that matters:

* **admission** (:func:`hyperrl.loop.admission.admit`): a prompt group is admitted only
  while ``(η + V + 1)·batch`` bounds the live-or-consumed groups — the workers never run ahead
  further than η can absorb;
* **consumption** (:func:`~hyperrl.loop.admission.take_batch`): earliest deadline first;
  the learner waits rather than trains a group past ``v_admitted + η`` (nothing is discarded);
* **publication** is pause → publish → resume: the learner interrupts the workers, each stops at
  its next decode step and hands its unfinished rows back (``finish_reason = aborted``), the new
  weights are published, and those rows resume from their exact partial tokens under version
  ``V + 1`` (:func:`hyperrl.rollout.resume_requests`) — one row, several versions, every token
  stamped (``async.kv_cache: keep``: parked at the step instead, and continued over the old KV
  cache). Each wait has a deadline (``timeout_s``): a stuck worker fails the step naming it, and
  the engines keep serving the old version; a dead Ray worker is restarted at the current version
  and its requests generated again.

**Schedules** (``async.schedule``): ``free`` as above, every call and take written to
``out_dir/async_events.jsonl`` (``async.replay`` runs them again, bit for bit); ``gated`` —
batch k generated whole at version ``max(0, k − η)``, reproducible without a log.

Every step validates the batch against the contract with the bound
(``validate(..., learner_version=V, max_staleness=η)``) and reports ``staleness_*`` and the
buffer's counters (``async_admitted``, ``async_consumed``, ``async_evicted``, ``async_restarts``,
…; the conservation law is checked each step). A group whose rows break the contract is evicted
with the reason naming the worker and its prompt re-admitted: nothing trained on it, nothing
lost. ``η = 0`` is synchronous: the same batches, metrics and weights as
:class:`~hyperrl.loop.trainer.SyncTrainer` (tested bit for bit).

:class:`~hyperrl.loop.trainer.AsyncTrainer` is the trainer with this collector: rewards and shaping
(:func:`~hyperrl.loop.collect.score_and_shape`), prepare, the pipeline, the learner and the publisher
are the synchronous run's own code; only collection differs.

**Kinds of rollout**: what a unit requests and what becomes of its finished rows is the run's
:class:`~hyperrl.loop.drivers.Driver`'s — plain samples; **multi-turn** episodes (``env``), each turn a
request, each action stepped by its environment on a thread pool in this process, in lockstep at η = 0
and gated (the synchronous round's batches, bit for bit) — a dead worker loses only its turns in flight
(they wait again, unchanged), a resumed run starts its live episodes again; **agent programs**
(``env: {name: agent}``), a unit's n episodes as one round on a thread of their own, their gateway calls
requests like any. The units, rows and waiting requests are the :class:`~hyperrl.loop.async_queue.AsyncQueue`'s;
this collector coordinates. Not yet here: group filters with refill (docs/async.md says what exists).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from hyperrl import transforms as T
from hyperrl.loop import admission as A
from hyperrl.loop.async_queue import AsyncQueue
from hyperrl.loop.collect import Collected, Timer, score_and_shape
from hyperrl.rollout.workers.base import WorkerDied, WorkerError
from hyperrl.rollout.workers.schedules import make_schedule
from hyperrl.trajectory import cat_batches, validate

__all__ = ["AsyncCollector", "WorkerError"]


class AsyncCollector:
    """Rollout workers generating ahead of the learner within the staleness bound (module doc).
    ``workers``: an executor's :class:`~hyperrl.rollout.workers.base.Workers` (its ``engine`` is
    the one the trainer publishes to and evaluates with); ``rollout``: the config's section; the
    async settings as the config's ``async`` section checked them at load. ``log``: the event log
    of a free-running run (None: not recorded); ``fresh``: start it anew (a resumed run appends).
    ``queue``: the shared state (:class:`~hyperrl.loop.async_queue.AsyncQueue`); ``driver``: the
    generator's (:class:`~hyperrl.loop.drivers.Driver`)."""

    def __init__(self, workers, task, generator, scorer, pipeline, rollout, *, eta: int, max_concurrent: int,
                 timeout_s: float, schedule: str, replay: str | None, kv_cache: str, seed: int, threads: int,
                 log: Path | None, fresh: bool):
        self.executor, self.engine, self.task, self.generator = workers, workers.engine, task, generator
        self.scorer, self.pipeline, self.rollout, self.seed, self.threads = scorer, pipeline, rollout, seed, threads
        self.eta, self.driver, self.restarts = eta, generator.driver, 0
        self.schedule = make_schedule(schedule, replay)  # free, gated or the replay of a recorded run
        self.workers = list(workers.workers)
        self.keep_kv = kv_cache == "keep" and self.schedule.interrupts  # parked over the kept cache, not interrupted
        for w in self.workers:
            w.keep_kv = self.keep_kv
        buffer = A.buffer_init(eta, rollout.prompts_per_step, max_concurrent or (eta + 1) * rollout.prompts_per_step)
        self.queue = AsyncQueue(task, rollout, self.engine, self.driver, buffer, workers=[w.name for w in self.workers],
                                timeout_s=timeout_s, log=log if self.schedule.records else None, fresh=fresh)
        # η = 0 or gated: multi-turn episodes' turns in lockstep — the synchronous round's batch exactly,
        # whatever order the environment steps finished in (free at η > 0 overlaps them instead)
        self.driver.attach(generator, self.queue, lockstep=eta == 0 or self.schedule.whole_steps)
        self.scoring: dict = {}  # unit uid → its scoring, started as it was ready (rewards off this thread)
        if scorer.overlaps:
            self.queue.on_ready = self._start_scoring
        self.start_workers()

    def _start_scoring(self, uid: int, key: int, rows) -> None:
        """(a worker's thread, under the lock) A unit is ready: its rewards start now, hidden behind the rest of
        the generation — every reward runs off this thread (``Scorer.overlaps``), so nothing here waits."""
        try:
            self.scoring[uid] = self.scorer.submit(rows, {key: self.queue.sample(key)})
        except Exception as e:  # noqa: BLE001 - the rewards' failure, raised when the learner takes the unit
            self.scoring[uid] = e

    def start_workers(self) -> None:
        """Start (or, after :meth:`stop_workers`, restart) one driver thread per rollout worker."""
        q = self.queue
        with q.cond:
            q.stopped, q.errors = False, {}
        for w in self.workers:
            w.resume()
        q.threads = [threading.Thread(target=self._work, args=(w,), name=w.name, daemon=True) for w in self.workers]
        for t in q.threads:
            t.start()

    def _work(self, w) -> None:
        """(a worker's thread) Take a call when the schedule and the driver allow, generate it, deliver its rows;
        a dead worker's requests wait again, unchanged, and it restarts at the current version."""
        q = self.queue
        try:
            if self.threads:  # torch's intra-op threads are per calling thread: the worker's own count
                torch.set_num_threads(self.threads)
            sp = dataclasses.replace(self.generator.sampling(0), seed=self.seed * 7919)  # SyncTrainer's keyed seed
            while True:
                with q.cond:
                    q.cond.wait_for(lambda: q.stopped or (not q.paused and self.schedule.can_take(q)
                                                          and self.driver.ready()))
                    if q.stopped:
                        return
                    reqs, stop_after, record = q.call(self.schedule)
                    reqs = self.driver.order(reqs)
                    q.busy.add(w.name)
                try:  # busy until the rows are delivered (or the worker restarted): a publication waits
                    wall, t0 = time.time(), time.perf_counter()
                    try:
                        out, steps = w.generate_requests(reqs, sp, stop_after)
                    except WorkerDied:  # its requests came back to nobody: they wait again, unchanged
                        with q.cond:
                            q.timeline.append({"call": record["call"], "worker": w.name, "died": True,
                                               "version": record["version"], "requests": len(reqs), "t0": wall,
                                               "dur": time.perf_counter() - t0})
                            q.pending = reqs + q.pending
                            self.schedule.died(record.get("replayed"))
                            self.restarts += 1
                            q.cond.notify_all()
                        w.restart()  # serving the current version (or a WorkerError naming it)
                        continue
                    q.deliver(out, w.name, {**record, "worker": w.name, "steps": steps}, t0=wall,
                              dur=time.perf_counter() - t0)
                finally:
                    with q.cond:
                        q.busy.discard(w.name)
                        q.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 — reported to the learner, which fails the step naming it
            with q.cond:
                q.fail(w.name, e)

    def collect(self, step: int, version: int, timer: Timer) -> Collected:
        """The earliest-deadline units ready at the learner's ``version`` (waiting, with the deadline,
        until there are enough), validated against η, scored and shaped."""
        q, taken = self.queue, []
        with timer("wait"), q.cond:
            q.version = version
            q.top_up()
            keys = self.schedule.batch_keys(step)

            def ready():
                got = q.take(keys)
                taken.extend(got or ())
                return got is not None

            q.wait(ready, f"waiting for a batch at version {version}")
            rows = q.consume(step, taken)
            events, q.timeline = q.timeline, []
            counts = [w.restarts for w in self.workers if w.restarts is not None]  # a Ray worker counts its own
            b = q.buffer
            counters = {"async_admitted": b.admitted, "async_consumed": b.consumed, "async_evicted": b.evicted,
                        "async_in_flight": b.in_flight, "async_ready": b.ready,
                        "async_restarts": max(sum(counts), self.restarts) if counts else self.restarts}
        if not rows:  # agents: no episode of the step's groups left a row
            raise self.driver.no_rows(step, len(taken))
        batch = cat_batches(rows, self.engine.pad_id)
        validate(batch, learner_version=version, max_staleness=self.eta)  # every token within η
        samples = {u.key: q.sample(u.key) for u in taken}
        with q.cond:
            ready = [self.scoring.pop(u.uid) for u in taken if u.uid in self.scoring] if q.on_ready else None
        for h in ready or ():
            if isinstance(h, Exception):  # starting its scoring failed (named there): this step's error
                raise h
        overlap = self._overlap(ready, time.perf_counter()) if ready else {}
        with timer("reward"):
            batch = score_and_shape(batch, samples, self.scorer, self.pipeline, ready)
        st = T.staleness_metrics(batch["token_version"], batch["action_mask"], version, self.eta)
        with q.cond:
            agents = self.driver.pop_stats()  # the agent rounds finished since the last step
        # the engine's own scheduler figures since the last step (an engine that keeps them: vLLM's, on the thread
        # executor; a Ray group's actors keep theirs)
        engine = self.engine.pop_stats() if self.engine.capabilities.stats else {}
        return Collected(batch, {**counters, **agents, **engine, **overlap, **{k: float(v) for k, v in st.items()}},
                         samples, events)

    @staticmethod
    def _overlap(ready: list, now: float) -> dict[str, float]:
        """How much of the step's scoring hid behind generation: ``reward_hidden_frac`` — the groups whose scores
        were all in when the learner took them; ``reward_latency_s`` — the mean time from a group's last row to
        its last score (still running: until now)."""
        ends = [h.pending.finished_at() if h.pending is not None else h.t0 for h in ready]
        return {"reward_hidden_frac": sum(e is not None for e in ends) / len(ends),
                "reward_latency_s": sum((e if e is not None else now) - h.t0 for e, h in zip(ends, ready)) / len(ends)}

    def _pause(self, what: str, *, drain: bool = True) -> None:
        """Stop the workers taking requests and wait (deadline) until none is generating. Free: the
        running generations are interrupted (their rows resume later). Gated: nothing is
        interrupted — the pause waits until every admitted request is generated, so each batch
        comes from exactly one version. Replay (``drain``: before a publication): the log's calls at
        this version run first, each stopping where the recorded one was interrupted."""
        q = self.queue
        with q.cond:
            try:
                self.schedule.drain(q, what, drain)
                q.paused = True
                if self.keep_kv:  # park every running generation at its next step, its cache kept
                    for w in self.workers:
                        w.hold(q.notify)
                    q.wait(lambda: all(w.parked or w.name not in q.busy for w in self.workers), what)
                    return
                if self.schedule.interrupts:
                    for w in self.workers:
                        w.interrupt()
                q.wait(lambda: not q.busy, what)
            except WorkerError:
                self._unpause()
                raise

    def _unpause(self) -> None:
        """(under the lock) Let the workers take requests again (and parked generations go on)."""
        for w in self.workers:
            w.resume()
            if self.keep_kv:
                w.release()
        self.queue.paused = False
        self.queue.top_up()
        self.queue.cond.notify_all()

    @contextmanager
    def paused(self, what: str, *, drain: bool = True):
        """Pause the workers (interrupt in-flight generation, wait for them to hand their rows back;
        gated: wait for the admitted requests instead), run the body (a publication, an
        evaluation), resume; interrupted rows continue under the new weights. The body may publish
        a new version: the collector follows the engine's."""
        self._pause(what, drain=drain)
        try:
            yield
        finally:
            with self.queue.cond:
                self.queue.version = self.engine.policy_version
                self._unpause()

    def stop_workers(self) -> None:
        """Stop the driver threads (the workers and the engine stay as they are)."""
        q = self.queue
        with q.cond:
            q.stopped = True
            for w in self.workers:
                w.interrupt()
            q.cond.notify_all()
        for t in q.threads:  # interrupted, a thread ends at its next decode step: wait for it (a thread
            t.join(timeout=max(q.timeout_s, 60.0))  # left inside torch at exit aborts the process: SIGABRT)

    def close(self) -> None:
        """Stop the driver threads and release the workers (Ray actors, a Ray started for the run); the
        environments' steps under way finish on their own (none is waited for)."""
        self.stop_workers()
        self.driver.detach()
        self.executor.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 — interpreter shutdown
            pass

    def state(self) -> dict:
        """The buffer at a step boundary, losslessly: the prompts of every live unit (in flight or
        ready, in admission order) and of evicted-not-yet-readmitted ones, the data cursor, the
        counters, and the rows of the ready units an older version generated (tensors: the
        checkpoint keeps them in ``state.safetensors``). On resume those are ready again as they
        were; the rest are admitted again first and regenerated — under the resumed weights, with
        the same sample_uids — so nothing is lost or trained twice, the staleness bound holds
        across the restart, and a gated run continues bit for bit (batch k still from version
        k − η)."""
        with self.queue.cond:
            return {"async": self.queue.state()}

    def load_state(self, state: dict) -> None:
        """The buffer of a checkpoint (:meth:`state`): its prompts are admitted again first."""
        st = state.get("async")
        if st is None:
            raise ValueError("resume: the checkpoint was written by a synchronous run (no async state); resume it "
                             "with async.max_staleness: null or start a new out_dir")
        with self.queue.cond:
            self.queue.load_state(st)
