"""AsyncTrainer: rollout and learning overlap, every trained token at most η versions stale.

A rollout worker (here a thread that owns the engine) generates admitted requests while the
learner trains on earlier ones. The pure pieces decide everything that matters:

* **admission** (:func:`hyperrl.transforms.admission.admit`): a prompt group is admitted only
  while ``(η + V + 1)·batch`` bounds the live-or-consumed groups — the worker never runs ahead
  further than η can absorb;
* **consumption** (:func:`~hyperrl.transforms.admission.take_batch`): earliest deadline first;
  the learner waits rather than trains a group past ``v_admitted + η`` (nothing is discarded);
* **publication** is pause → publish → resume: the learner sets the abort flag, the worker stops
  at its next decode step and hands its unfinished rows back (``finish_reason = aborted``), the new
  weights are published, and those rows resume from their exact partial tokens under version
  ``V + 1`` (:func:`hyperrl.rollout.resume_requests`) — one row, several versions, every token
  stamped. Each wait has a deadline (``timeout_s``): a stuck or dead worker fails the step with
  an error naming it, and the engine keeps serving the old version.

Every step validates the batch against the contract with the bound
(``validate(..., learner_version=V, max_staleness=η)``) and reports ``staleness_*`` and the
buffer's counters (``async_admitted``, ``async_consumed``, ``async_evicted``, …; the conservation
law is checked each step). A group whose rows break the contract is evicted with the reason and
its prompt re-admitted: nothing trained on it, nothing lost. ``η = 0`` is synchronous: the same
batches, metrics and weights as :class:`~hyperrl.trainer.SyncTrainer` (tested bit for bit).

The steps are those of the SyncTrainer (rewards, prepare, the pipeline, the learner, the
publisher); only collection differs. Not yet here: multi-turn environments, group filters with
refill, the Ray executor (docs/async.md says what exists).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch
from tensordict import TensorDict

from . import transforms as T
from .rollout.requests import Request, resume_requests
from .trainer import SyncTrainer, _Timer
from .trajectory import FINISH_REASONS, TrajectoryError, cat_batches, validate
from .transforms import admission as A

__all__ = ["AsyncTrainer", "WorkerError"]

_ABORTED = FINISH_REASONS.index("aborted")


class WorkerError(RuntimeError):
    """A rollout worker died, hung past its deadline, or returned rows that break the contract."""


class AsyncTrainer(SyncTrainer):
    def __init__(self, cfg, *, max_staleness: int, max_concurrent: int = 0, timeout_s: float = 120.0, **kw):
        super().__init__(cfg, **kw)
        r = cfg.rollout
        if not getattr(self.engine, "resumable", False):
            raise ValueError(f"rollout.engine={cfg.rollout.engine.name}: asynchronous RL needs an engine with "
                             "resumable requests (generate_requests: keyed sampling, abort, resume); the "
                             "transformers engine has them")
        if getattr(self.engine, "shared", False):
            raise ValueError("rollout.engine.share_weights: the engine would generate from weights the learner is "
                             "changing; an asynchronous run needs its own copy (share_weights: false)")
        if self.make_env is not None or self.pipeline.filter is not None or "baseline_reward" in self.pipeline.needs:
            raise ValueError("AsyncTrainer: multi-turn environments, group filters with refill and ReMax's greedy "
                             "baseline are synchronous-only for now; use SyncTrainer")
        if self.parallel.world > 1:
            raise ValueError("AsyncTrainer: one process for now (the Ray executor is the multi-process one)")
        self.eta, self.timeout_s = max_staleness, timeout_s
        self.buffer = A.buffer_init(max_staleness, r.prompts_per_step, max_concurrent or
                                    (max_staleness + 1) * r.prompts_per_step)
        self._cond = threading.Condition()
        self._abort, self._paused, self._busy, self._stop = threading.Event(), False, False, False
        self._pending: list[Request] = []  # requests for the worker (resumed ones first)
        self._rows: dict[int, list[TensorDict]] = {}  # unit uid → its finished rows
        self._units: dict[int, A.Unit] = {}
        self._draws: dict[int, list] = {}  # step → the task's prompts of that step (unit key k: step k // P)
        self._requeue: list[int] = []  # keys of evicted units, admitted again first
        self._next_key, self._worker_error = 0, None
        self.start_worker()

    def start_worker(self) -> None:
        """Start (or, after :meth:`close`, restart) the rollout worker over ``self.engine``."""
        with self._cond:
            self._stop, self._worker_error = False, None
            self._abort.clear()
        self._worker = threading.Thread(target=self._work, name="rollout-worker-0", daemon=True)
        self._worker.start()

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
            self._rows[u.uid] = []
            self._pending.extend(self._requests(u))
        keys = {u.key for u in new}
        self._requeue = [k for k in self._requeue if k not in keys]
        self._next_key = max([self._next_key] + [k + 1 for k in keys])
        if new:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the rollout worker
    def _work(self) -> None:
        try:
            if self.cfg.run.threads:  # torch's intra-op threads are per calling thread: the worker's own count
                torch.set_num_threads(self.cfg.run.threads)
            sp = dataclasses.replace(self._sampling(0), seed=self.cfg.run.seed * 7919)  # SyncTrainer's keyed seed
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or (self._pending and not self._paused))
                    if self._stop:
                        return
                    reqs, self._pending, self._busy = self._pending, [], True
                try:  # busy until the rows are delivered: a publication waits for both
                    self._deliver(self.engine.generate_requests(reqs, sp, abort=self._abort))
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 — reported to the learner, which fails the step naming it
            with self._cond:
                self._worker_error = e
                self._cond.notify_all()

    def _deliver(self, out: TensorDict) -> None:
        """Finished rows go to their unit (complete when all n are in); aborted rows resume."""
        resumed = resume_requests(out)
        done = out[out["finish_reason"] != _ABORTED]
        unit_of = {}
        with self._cond:
            for u in self._units.values():
                unit_of[u.key] = u.uid
            for i in range(done.batch_size[0]):
                uid = unit_of[int(done["group_id"][i])]
                self._rows[uid].append(done[i:i + 1])
                if len(self._rows[uid]) == self.cfg.rollout.n:
                    self._complete(uid)
            self._pending = resumed + self._pending
            self._top_up()
            self._cond.notify_all()

    def _complete(self, uid: int) -> None:
        rows = cat_batches(self._rows[uid], self.engine.pad_id)
        want = sorted(r.uid for r in self._requests(self._units[uid]))
        try:  # the worker's contract: versions stamped, the unit's own uids, each once
            validate(rows)
            if sorted(rows["sample_uid"].tolist()) != want:
                raise TrajectoryError(f"sample_uid: {sorted(rows['sample_uid'].tolist())}, expected {want}")
            self._rows[uid] = [rows]
            self.buffer = A.complete(self.buffer, uid)
        except TrajectoryError as e:
            self.buffer = A.evict(self.buffer, uid, f"{self._worker.name}: {e}")
            self._requeue.append(self._units.pop(uid).key)
            self._rows.pop(uid)

    # ------------------------------------------------------------------ the learner's side
    def _check_worker(self) -> None:
        if self._worker_error is not None:
            raise WorkerError(f"{self._worker.name} died: {type(self._worker_error).__name__}: "
                              f"{self._worker_error}") from self._worker_error
        if not self._worker.is_alive():
            raise WorkerError(f"{self._worker.name} is not running")

    def _wait(self, pred, what: str) -> None:
        """Wait (under the lock) for ``pred`` with the deadline; a dead or stuck worker is an error."""
        deadline = time.monotonic() + self.timeout_s
        while not pred():
            self._check_worker()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self._worker.name}: no progress in {self.timeout_s:.0f} s while {what} "
                                  f"(in flight {self.buffer.in_flight}, ready {self.buffer.ready}); still serving "
                                  f"version {self.engine.policy_version}")
            self._cond.wait(min(left, 1.0))

    def collect(self, timer: _Timer) -> tuple[TensorDict, dict]:
        taken = []
        with timer("wait"), self._cond:
            self._top_up()

            def ready():
                self.buffer, got = A.take_batch(self.buffer, self.version)
                if got is not None:
                    taken.extend(got)
                return got is not None

            self._wait(ready, f"waiting for a batch at version {self.version}")
            rows = [self._rows.pop(u.uid)[0] for u in taken]
            for u in taken:
                self._units.pop(u.uid)
            self._prune_draws()
            A.check_conservation(self.buffer)
            counters = {"async_admitted": self.buffer.admitted, "async_consumed": self.buffer.consumed,
                        "async_evicted": self.buffer.evicted, "async_in_flight": self.buffer.in_flight,
                        "async_ready": self.buffer.ready}
        batch = cat_batches(rows, self.engine.pad_id)
        validate(batch, learner_version=self.version, max_staleness=self.eta)  # every token within η
        samples = {u.key: self._sample(u.key) for u in taken}
        with timer("reward"):
            batch = self.pipeline.admit(self.rewards(batch, samples))
        self._samples = samples
        st = T.staleness_metrics(batch["token_version"], batch["action_mask"], self.version, self.eta)
        return batch, {**counters, **{k: float(v) for k, v in st.items()}}

    def publish(self) -> None:
        """Pause (abort in-flight generation, wait for the worker to hand its rows back), publish
        V + 1, resume; the aborted rows continue under the new weights."""
        with self._cond:
            self._paused = True
            self._abort.set()
            try:
                self._wait(lambda: not self._busy, f"pausing for the publication of version {self.version + 1}")
            except WorkerError:
                self._paused = False
                self._abort.clear()
                raise
        try:
            super().publish()
        finally:
            with self._cond:
                self._abort.clear()
                self._paused = False
                self._top_up()
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the worker thread (the engine stays as it is)."""
        with self._cond:
            self._stop = True
            self._abort.set()
            self._cond.notify_all()
        self._worker.join(timeout=self.timeout_s)

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
            self._units, self._rows, self._pending = {}, {}, []
            self._requeue, self._next_key = list(st["live"]), st["next_key"]

    @torch.no_grad()
    def evaluate(self) -> dict:
        with self._cond:  # the engine is the worker's: evaluate while it is paused
            self._paused = True
            self._abort.set()
            self._wait(lambda: not self._busy, "pausing for evaluation")
        try:
            return super().evaluate()
        finally:
            with self._cond:
                self._abort.clear()
                self._paused = False
                self._cond.notify_all()
