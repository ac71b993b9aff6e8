"""AsyncTrainer: rollout and learning overlap, every trained token at most η versions stale.

Rollout workers (``async.executor``: a thread of this process driving the run's engine, or Ray
actors each holding a copy — :mod:`hyperrl.rollout.workers`) generate admitted requests while the
learner trains on earlier ones, one driver thread per worker. The pure pieces decide everything
that matters:

* **admission** (:func:`hyperrl.transforms.admission.admit`): a prompt group is admitted only
  while ``(η + V + 1)·batch`` bounds the live-or-consumed groups — the workers never run ahead
  further than η can absorb;
* **consumption** (:func:`~hyperrl.transforms.admission.take_batch`): earliest deadline first;
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
:class:`~hyperrl.trainer.SyncTrainer` (tested bit for bit).

The steps are those of the SyncTrainer (rewards, prepare, the pipeline, the learner, the
publisher); only collection differs. Not yet here: multi-turn environments, group filters with
refill (docs/async.md says what exists).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from . import transforms as T
from .rollout.requests import Request, resume_requests
from .rollout.workers import EXECUTORS, LIVE, WorkerDied, WorkerError
from .trainer import SyncTrainer, _Timer
from .trajectory import FINISH_REASONS, TrajectoryError, cat_batches, validate
from .transforms import admission as A

__all__ = ["AsyncTrainer", "WorkerError", "SCHEDULES"]

_ABORTED = FINISH_REASONS.index("aborted")
SCHEDULES = ("free", "gated")


@dataclasses.dataclass
class _Log:
    """A recorded free-running run: its worker calls (in the order they started) and its takes."""

    calls: list[dict]
    takes: dict[int, list]


def _read_event_log(path) -> _Log:
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
    return _Log(sorted(calls, key=lambda e: e["call"]), takes)


class AsyncTrainer(SyncTrainer):
    def __init__(self, cfg, *, engine, max_staleness: int | None = None, max_concurrent: int | None = None,
                 timeout_s: float | None = None, schedule: str | None = None, executor=None,
                 replay: str | None = None, kv_cache: str | None = None, **kw):
        """The ``async`` section of ``cfg`` gives every setting not passed here."""
        r, a = cfg.rollout, getattr(cfg, "async")
        max_staleness = a.max_staleness if max_staleness is None else max_staleness
        max_concurrent = a.max_concurrent if max_concurrent is None else max_concurrent
        timeout_s = a.timeout_s if timeout_s is None else timeout_s
        schedule = a.schedule if schedule is None else schedule
        replay = a.replay if replay is None else replay
        kv_cache = a.kv_cache if kv_cache is None else kv_cache
        if max_staleness is None:
            raise ValueError("async.max_staleness: not set; the AsyncTrainer needs the staleness bound η ≥ 0")
        if max_staleness < 0:
            raise ValueError(f"async.max_staleness={max_staleness}: must be ≥ 0 (0 = synchronous)")
        if not getattr(engine, "resumable", False):
            raise ValueError(f"rollout.engine={cfg.rollout.engine.name}: asynchronous RL needs an engine with "
                             "resumable requests (generate_requests: keyed sampling, abort, resume); the "
                             "transformers engine has them")
        if getattr(engine, "shared", False):
            raise ValueError("rollout.engine.share_weights: the engine would generate from weights the learner is "
                             "changing; an asynchronous run needs its own copy (share_weights: false)")
        if schedule not in SCHEDULES:
            raise ValueError(f"async.schedule={schedule!r}: one of {SCHEDULES}")
        if replay is not None and schedule != "free":
            raise ValueError(f"async.replay with async.schedule={schedule}: an event log records a free-running run "
                             "(a gated run reproduces without one)")
        if kv_cache not in ("reprefill", "keep"):
            raise ValueError(f"async.kv_cache={kv_cache!r}: one of reprefill, keep")
        if kv_cache == "keep" and replay is not None:
            raise ValueError("async.kv_cache=keep with async.replay: where a kept cache met new weights is not in the "
                             "event log; replay a run recorded with kv_cache: reprefill")
        if schedule == "gated" and max_concurrent and max_concurrent < (max_staleness + 1) * r.prompts_per_step:
            raise ValueError(f"async.max_concurrent={max_concurrent}: the gated schedule admits whole steps — set 0 "
                             f"or ≥ (η + 1) · rollout.prompts_per_step = {(max_staleness + 1) * r.prompts_per_step}")
        ex = executor if executor is not None else a.executor
        self.executor = EXECUTORS.build(ex.name, **ex.args)(engine)
        try:
            super().__init__(cfg, engine=self.executor.engine, **kw)
            if self.make_env is not None or self.pipeline.filter is not None or \
                    "baseline_reward" in self.pipeline.needs:
                raise ValueError("AsyncTrainer: multi-turn environments, group filters with refill and ReMax's greedy "
                                 "baseline are synchronous-only for now; use SyncTrainer")
            if self.parallel.world > 1:
                raise ValueError("AsyncTrainer: one learner process (rollout workers scale with async.executor: "
                                 "{name: ray, workers: N})")
        except BaseException:
            self.executor.close()
            raise
        self.eta, self.timeout_s, self.schedule = max_staleness, timeout_s, schedule
        self.workers = list(self.executor.workers)
        self.keep_kv = kv_cache == "keep" and schedule == "free"
        if self.keep_kv:
            if not all(hasattr(w, "hold") for w in self.workers):
                self.executor.close()
                raise ValueError(f"async.kv_cache=keep: the {ex.name} executor's workers cannot park mid-generation "
                                 "(the thread executor's can); use kv_cache: reprefill")
            for w in self.workers:
                w.keep_kv = True
        self.buffer = A.buffer_init(max_staleness, r.prompts_per_step, max_concurrent or
                                    (max_staleness + 1) * r.prompts_per_step)
        self._cond = threading.Condition()
        self._paused, self._stop = False, False
        self._busy: set[str] = set()  # workers generating (or restarting): a publication waits for none
        self._errors: dict[str, BaseException] = {}
        self._pending: list[Request] = []  # requests for the workers (resumed ones first)
        self._rows: dict[int, list[TensorDict]] = {}  # unit uid → its finished rows
        self._by: dict[int, set[str]] = {}  # unit uid → the workers that delivered its rows
        self._units: dict[int, A.Unit] = {}
        self._draws: dict[int, list] = {}  # step → the task's prompts of that step (unit key k: step k // P)
        self._requeue: list[int] = []  # keys of evicted units, admitted again first
        self._next_key, self.restarts = 0, 0
        # the event log: every worker call (its requests, version, decode steps before an interruption)
        # and every batch taken — what a replay needs to run the same calls and takes (module doc)
        self._replay = _read_event_log(replay) if replay is not None else None
        self._log = Path(cfg.run.out_dir) / "async_events.jsonl" if schedule == "free" and replay is None else None
        if self._log is not None and self.checkpointer.latest() is None:
            self._log.parent.mkdir(parents=True, exist_ok=True)
            self._log.write_text("")  # a fresh run: a fresh log (a resumed one appends)
        self._seq = 0
        self.start_workers()

    def start_workers(self) -> None:
        """Start (or, after :meth:`stop_workers`, restart) one driver thread per rollout worker."""
        with self._cond:
            self._stop, self._errors = False, {}
        for w in self.workers:
            w.resume()
        self._threads = [threading.Thread(target=self._work, args=(w,), name=w.name, daemon=True)
                         for w in self.workers]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ what a unit is
    def _sample(self, key: int):
        P = self.cfg.rollout.prompts_per_step
        step, g = divmod(key, P)
        if step not in self._draws:
            self._draws[step] = self.task.sample(P, step, attempt=0)
        return self._draws[step][g]

    def _prune_draws(self) -> None:
        """Forget the draws of steps no live, re-admittable or future unit can come from."""
        P = self.cfg.rollout.prompts_per_step
        low = min([u.key for u in self.buffer.units] + self._requeue + [self._next_key]) // P
        for step in [s for s in self._draws if s < low]:
            del self._draws[step]

    def _requests(self, unit: A.Unit) -> list[Request]:
        """The unit's n requests; uids as the SyncTrainer numbers them (step, prompt, sample)."""
        step, g = divmod(unit.key, self.cfg.rollout.prompts_per_step)
        prompt = tuple(self.task.encode(self._sample(unit.key)))
        return [Request(self.sample_uid(step, 0, g, j), prompt, unit.key) for j in range(self.cfg.rollout.n)]

    def _top_up(self) -> None:
        """Admit what capacity allows (under the lock): evicted prompts first, then fresh ones."""
        want = self._requeue + list(range(self._next_key, self._next_key + self.buffer.max_concurrent))
        self.buffer, new = A.admit(self.buffer, want, self.version)
        for u in new:
            self._units[u.uid] = u
            self._rows[u.uid], self._by[u.uid] = [], set()
            self._pending.extend(self._requests(u))
        keys = {u.key for u in new}
        self._requeue = [k for k in self._requeue if k not in keys]
        self._next_key = max([self._next_key] + [k + 1 for k in keys])
        if new:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the rollout workers' threads
    def _can_take(self) -> bool:
        """(under the lock) Is there a call for a worker to make? Replay: the log's next call, once its
        requests wait and the engine serves its version."""
        if self._paused:
            return False
        if self._replay is None:
            return bool(self._pending)
        calls = self._replay.calls
        if not calls or calls[0]["version"] != self.engine.policy_version:
            return False
        waiting = {q.uid for q in self._pending}
        return all(u in waiting for u in calls[0]["uids"])

    def _take(self) -> tuple[list[Request], int | None, dict]:
        """(under the lock) A worker's call: its requests, ``stop_after`` and its log record. Free: an
        even share of what waits. Gated: the next fixed chunk of the earliest step (⌈P·n / workers⌉
        requests) — the same calls, with the same rows, in every run. Replay: the log's next call."""
        W, r = len(self.workers), self.cfg.rollout
        stop_after = LIVE
        if self._replay is not None:
            call = self._replay.calls.pop(0)
            by_uid = {q.uid: q for q in self._pending}
            reqs = [by_uid[u] for u in call["uids"]]
            taken = set(call["uids"])
            self._pending = [q for q in self._pending if q.uid not in taken]
            stop_after = call["steps"]
        else:
            if self.schedule == "gated":
                step = self._pending[0].group_id // r.prompts_per_step
                same = sum(1 for q in self._pending if q.group_id // r.prompts_per_step == step)
                k = min(same, math.ceil(r.prompts_per_step * r.n / W))
            else:
                k = math.ceil(len(self._pending) / W)
            reqs, self._pending = self._pending[:k], self._pending[k:]
        self._seq += 1
        record = {"call": self._seq, "version": self.engine.policy_version, "uids": [q.uid for q in reqs]}
        if self._replay is not None:
            record["replayed"] = call
        return reqs, stop_after, record

    def _work(self, w) -> None:
        try:
            if self.cfg.run.threads:  # torch's intra-op threads are per calling thread: the worker's own count
                torch.set_num_threads(self.cfg.run.threads)
            sp = dataclasses.replace(self._sampling(0), seed=self.cfg.run.seed * 7919)  # SyncTrainer's keyed seed
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._can_take())
                    if self._stop:
                        return
                    reqs, stop_after, record = self._take()
                    self._busy.add(w.name)
                try:  # busy until the rows are delivered (or the worker restarted): a publication waits
                    try:
                        out, steps = w.generate_requests(reqs, sp, stop_after)
                    except WorkerDied:  # its requests came back to nobody: they wait again, unchanged
                        with self._cond:
                            self._pending = reqs + self._pending
                            if self._replay is not None:
                                self._replay.calls.insert(0, record["replayed"])
                            self.restarts += 1
                            self._cond.notify_all()
                        w.restart()  # serving the current version (or a WorkerError naming it)
                        continue
                    self._deliver(out, w.name, {**record, "worker": w.name, "steps": steps})
                finally:
                    with self._cond:
                        self._busy.discard(w.name)
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 — reported to the learner, which fails the step naming it
            with self._cond:
                self._errors[w.name] = e
                self._cond.notify_all()

    def _record(self, event: dict) -> None:
        """(under the lock) Append one event to the run's log (free-running runs)."""
        if self._log is not None:
            with self._log.open("a") as f:
                f.write(json.dumps(event) + "\n")

    def _deliver(self, out: TensorDict, name: str, record: dict) -> None:
        """Finished rows go to their unit (complete when all n are in); aborted rows resume."""
        resumed = resume_requests(out)
        done = out[out["finish_reason"] != _ABORTED]
        with self._cond:
            record.pop("replayed", None)
            self._record(record)
            unit_of = {u.key: u.uid for u in self._units.values()}
            for i in range(done.batch_size[0]):
                uid = unit_of[int(done["group_id"][i])]
                self._rows[uid].append(done[i:i + 1])
                self._by[uid].add(name)
                if len(self._rows[uid]) == self.cfg.rollout.n:
                    self._complete(uid)
            self._pending = resumed + self._pending
            self._top_up()
            self._cond.notify_all()

    def _complete(self, uid: int) -> None:
        rows = cat_batches(self._rows[uid], self.engine.pad_id)
        rows = rows[torch.argsort(rows["sample_uid"])]  # the unit's rows in uid order, whichever worker came first
        want = sorted(r.uid for r in self._requests(self._units[uid]))
        try:  # the workers' contract: versions stamped, the unit's own uids, each once
            validate(rows)
            if sorted(rows["sample_uid"].tolist()) != want:
                raise TrajectoryError(f"sample_uid: {sorted(rows['sample_uid'].tolist())}, expected {want}")
            self._rows[uid] = [rows]
            self.buffer = A.complete(self.buffer, uid)
        except TrajectoryError as e:
            self.buffer = A.evict(self.buffer, uid, f"{', '.join(sorted(self._by[uid]))}: {e}")
            self._requeue.append(self._units.pop(uid).key)
            self._rows.pop(uid)
            self._by.pop(uid)

    # ------------------------------------------------------------------ the learner's side
    def _check_workers(self) -> None:
        for name, e in self._errors.items():
            if isinstance(e, WorkerError):
                raise WorkerError(str(e)) from e
            raise WorkerError(f"{name} died: {type(e).__name__}: {e}") from e
        for t in self._threads:
            if not t.is_alive():
                raise WorkerError(f"{t.name} is not running")

    def _wait(self, pred, what: str) -> None:
        """Wait (under the lock) for ``pred`` with the deadline; a dead or stuck worker is an error."""
        deadline = time.monotonic() + self.timeout_s
        while not pred():
            self._check_workers()
            left = deadline - time.monotonic()
            if left <= 0:
                who = ", ".join(sorted(self._busy)) or ", ".join(w.name for w in self.workers)
                raise WorkerError(f"{who}: no progress in {self.timeout_s:.0f} s while {what} "
                                  f"(in flight {self.buffer.in_flight}, ready {self.buffer.ready}); still serving "
                                  f"version {self.engine.policy_version}")
            self._cond.wait(min(left, 1.0))

    def collect(self, timer: _Timer) -> tuple[TensorDict, dict]:
        taken = []
        with timer("wait"), self._cond:
            self._top_up()

            keys = self._replayed_take()

            def ready():
                self.buffer, got = A.take_batch(self.buffer, self.version) if keys is None else \
                    A.take_units(self.buffer, keys)
                if got is not None:
                    taken.extend(got)
                return got is not None

            self._wait(ready, f"waiting for a batch at version {self.version}")
            self._record({"take": self.step_idx, "keys": [u.key for u in taken]})
            rows = [self._rows.pop(u.uid)[0] for u in taken]
            for u in taken:
                self._units.pop(u.uid)
                self._by.pop(u.uid)
            self._prune_draws()
            A.check_conservation(self.buffer)
            counters = {"async_admitted": self.buffer.admitted, "async_consumed": self.buffer.consumed,
                        "async_evicted": self.buffer.evicted, "async_in_flight": self.buffer.in_flight,
                        "async_ready": self.buffer.ready, "async_restarts": self.restarts}
        batch = cat_batches(rows, self.engine.pad_id)
        validate(batch, learner_version=self.version, max_staleness=self.eta)  # every token within η
        samples = {u.key: self._sample(u.key) for u in taken}
        with timer("reward"):
            batch = self.pipeline.admit(self.rewards(batch, samples))
        self._samples = samples
        st = T.staleness_metrics(batch["token_version"], batch["action_mask"], self.version, self.eta)
        return batch, {**counters, **{k: float(v) for k, v in st.items()}}

    def _replayed_take(self) -> list | None:
        """The unit keys the recorded run took at this step (None when not replaying)."""
        if self._replay is None:
            return None
        if self.step_idx not in self._replay.takes:
            raise ValueError(f"async.replay: the event log ends before step {self.step_idx} (it has "
                             f"{len(self._replay.takes)} steps)")
        return self._replay.takes[self.step_idx]

    def _pause(self, what: str, *, drain: bool = True) -> None:
        """Stop the workers taking requests and wait (deadline) until none is generating. Free: the
        running generations are interrupted (their rows resume later). Gated: nothing is
        interrupted — the pause waits until every admitted request is generated, so each batch
        comes from exactly one version. Replay (``drain``: before a publication): the log's calls at
        this version run first, each stopping where the recorded one was interrupted."""
        with self._cond:
            try:
                if self._replay is not None and drain:
                    calls = self._replay.calls
                    self._wait(lambda: not self._busy and (not calls or calls[0]["version"] > self.version), what)
                elif self.schedule == "gated":
                    self._wait(lambda: self.buffer.in_flight == 0 and not self._busy, what)
                self._paused = True
                if self.keep_kv:  # park every running generation at its next step, its cache kept
                    for w in self.workers:
                        w.hold(self._notify)
                    self._wait(lambda: all(w.parked or w.name not in self._busy for w in self.workers), what)
                    return
                if self.schedule == "free" and self._replay is None:
                    for w in self.workers:
                        w.interrupt()
                self._wait(lambda: not self._busy, what)
            except WorkerError:
                self._unpause()
                raise

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _unpause(self) -> None:
        """(under the lock) Let the workers take requests again (and parked generations go on)."""
        for w in self.workers:
            w.resume()
            if self.keep_kv:
                w.release()
        self._paused = False
        self._top_up()
        self._cond.notify_all()

    def publish(self) -> None:
        """Pause (interrupt in-flight generation, wait for the workers to hand their rows back), publish
        V + 1, resume; the interrupted rows continue under the new weights. Gated: wait for the
        admitted requests instead of interrupting them."""
        self._pause(f"pausing for the publication of version {self.version + 1}")
        try:
            super().publish()
        finally:
            with self._cond:
                self._unpause()

    def stop_workers(self) -> None:
        """Stop the driver threads (the workers and the engine stay as they are)."""
        with self._cond:
            self._stop = True
            for w in self.workers:
                w.interrupt()
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.timeout_s)

    def close(self) -> None:
        """Stop the driver threads and release the workers (Ray actors, a Ray started for the run)."""
        self.stop_workers()
        self.executor.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 — interpreter shutdown
            pass

    def _loop_state(self) -> dict:
        """The buffer at a step boundary, losslessly: the prompts of every live unit (in flight or
        ready, in admission order) and of evicted-not-yet-readmitted ones, the data cursor, the
        counters. On resume they are admitted again first and regenerated — under the resumed
        weights, with the same sample_uids, so nothing is lost or trained twice and the staleness
        bound holds across the restart (they are fresh)."""
        with self._cond:
            b = self.buffer
            return {"async": {"live": [u.key for u in b.units] + list(self._requeue), "next_key": self._next_key,
                              "consumed": b.consumed, "evicted": b.evicted,
                              "evictions": [list(e) for e in b.evictions]}}

    def _load_loop_state(self, state: dict) -> None:
        st = state.get("async")
        if st is None:
            raise ValueError("resume: the checkpoint was written by a synchronous run (no async state); resume it "
                             "with async.max_staleness: null or start a new out_dir")
        with self._cond:
            b = self.buffer
            self.buffer = A.Buffer(b.eta, b.batch, b.max_concurrent, (), st["consumed"] + st["evicted"],
                                   st["consumed"], st["evicted"], tuple(tuple(e) for e in st["evictions"]))
            self._units, self._rows, self._by, self._pending = {}, {}, {}, []
            self._requeue, self._next_key = list(st["live"]), st["next_key"]
            self._record({"resume": st.get("step", None)})

    @torch.no_grad()
    def evaluate(self) -> dict:
        self._pause("pausing for evaluation", drain=False)  # the engine is the workers': evaluate while paused
        try:
            return super().evaluate()
        finally:
            with self._cond:
                self._unpause()
