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

**Multi-turn** (``env``): a unit is a prompt's ``n`` episodes (:class:`hyperrl.envs.Episode`), each turn
a request keyed by ``call_key(sample_uid, turn)`` within the episode's budget; a finished turn goes to
its environment on a thread pool (a tool's wait overlaps generation), the next turn queues ahead of new
prompts, and the unit completes when its episodes are over. At η = 0 (and gated) the turns go in
lockstep — the synchronous round's batches, bit for bit. The environments live here: a dead worker loses
only its turns in flight (they wait again, unchanged); a resumed run starts its live episodes again.

**Agent programs** (``env: {name: agent}``): a unit's n episodes run as one round on a thread of their
own from admission (never paused); their gateway calls come in through :meth:`_submit` as requests and
are answered when generated — interrupted and resumed across publications like any. Not yet here:
group filters with refill (docs/async.md says what exists).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.agents import AgentError
from hyperrl.envs import Episode, episodes_batch
from hyperrl.loop import admission as A
from hyperrl.loop.async_schedules import make_schedule
from hyperrl.loop.collect import Collected, Timer, sample_uid, score_and_shape
from hyperrl.rollout.requests import Request, resume_requests
from hyperrl.rollout.workers.base import WorkerDied, WorkerError
from hyperrl.trajectory import FINISH_REASONS, TrajectoryError, cat_batches, validate

__all__ = ["AsyncCollector", "WorkerError"]

_ABORTED = FINISH_REASONS.index("aborted")


class AsyncCollector:
    """Rollout workers generating ahead of the learner within the staleness bound (module doc).
    ``workers``: an executor's :class:`~hyperrl.rollout.workers.base.Workers` (its ``engine`` is
    the one the trainer publishes to and evaluates with); ``rollout``: the config's section; the
    async settings as the config's ``async`` section checked them at load. ``log``: the event log
    of a free-running run (None: not recorded); ``fresh``: start it anew (a resumed run appends)."""

    def __init__(self, workers, task, generator, scorer, pipeline, rollout, *, eta: int, max_concurrent: int,
                 timeout_s: float, schedule: str, replay: str | None, kv_cache: str, seed: int, threads: int,
                 log: Path | None, fresh: bool):
        self.executor, self.engine, self.task, self.generator = workers, workers.engine, task, generator
        self.scorer, self.pipeline, self.rollout, self.seed, self.threads = scorer, pipeline, rollout, seed, threads
        self.eta, self.timeout_s = eta, timeout_s
        self.schedule = make_schedule(schedule, replay)  # free, gated or the replay of a recorded run
        self.workers = list(workers.workers)
        self.keep_kv = kv_cache == "keep" and schedule == "free"
        for w in self.workers:
            w.keep_kv = self.keep_kv
        self.buffer = A.buffer_init(eta, rollout.prompts_per_step, max_concurrent or
                                    (eta + 1) * rollout.prompts_per_step)
        self.version = self.engine.policy_version  # the learner's version (set by each collect / pause)
        self.step_idx = 0
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
        # multi-turn: the environments' episodes live here, in the learner's process (module doc)
        self.episodic = generator.make_env is not None
        self._episodes: dict[int, tuple[int, Episode]] = {}  # a turn request's uid → (unit uid, its episode)
        self._unit_eps: dict[int, list[Episode]] = {}  # unit uid → its n episodes
        self._turn_limits: dict[int, int] = {}  # a turn request's uid → its max_new_tokens (a resumed row lacks it)
        self._progress = 0  # turns generated and environment steps taken (a wait's liveness)
        self._stepping = 0  # environment steps under way
        # η = 0 or gated: turns in lockstep — a call waits until no environment step is under way and takes
        # every episode's next turn (of the earliest step, gated) in episode order: the synchronous round's
        # batch exactly, whatever order the steps finished in (bit for bit; free at η > 0 overlaps instead)
        self._lockstep = self.episodic and (eta == 0 or schedule == "gated")
        self._steps = ThreadPoolExecutor(rollout.max_concurrent_episodes, thread_name_prefix="hyperrl-env") \
            if self.episodic else None
        # agent programs: a unit's n episodes run as one round on a thread of their own (at most
        # max_concurrent_episodes episodes at once); their gateway calls come here as requests
        self.agentic = generator.agent is not None
        self._calls: dict[int, dict] = {}  # a gateway call's request uid → the call (its rows, its answer)
        self._agent_slots = threading.BoundedSemaphore(max(1, rollout.max_concurrent_episodes // rollout.n))
        self._agent_error = ""  # the last agent failure (an all-empty batch names it)
        self._agent_stats: dict[str, float] = {}  # the agent rounds' counts since the last step
        # the event log: every worker call (its requests, version, decode steps before an interruption)
        # and every batch taken — what a replay needs to run the same calls and takes (module doc)
        self._log = log if self.schedule.records else None
        if self._log is not None and fresh:
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
        P = self.rollout.prompts_per_step
        step, g = divmod(key, P)
        if step not in self._draws:
            self._draws[step] = self.task.sample(P, step, attempt=0)
        return self._draws[step][g]

    def _prune_draws(self) -> None:
        """Forget the draws of steps no live, re-admittable or future unit can come from."""
        P = self.rollout.prompts_per_step
        low = min([u.key for u in self.buffer.units] + self._requeue + [self._next_key]) // P
        for step in [s for s in self._draws if s < low]:
            del self._draws[step]

    def _uids(self, unit: A.Unit) -> list[int]:
        """The unit's n sample_uids, as the SyncTrainer numbers them (step, prompt, sample)."""
        r = self.rollout
        step, g = divmod(unit.key, r.prompts_per_step)
        return [sample_uid(step, 0, g, j, prompts_per_step=r.prompts_per_step, n=r.n,
                           max_generation_batches=r.max_generation_batches) for j in range(r.n)]

    def _requests(self, unit: A.Unit) -> list[Request]:
        """The unit's first requests: its n samples; multi-turn, the first turn of its n episodes
        (started now, each with a fresh environment)."""
        if self.agentic:  # the agents call the gateway; their calls come back through _submit
            threading.Thread(target=self._run_agents, args=(unit, self._sample(unit.key)), daemon=True,
                             name=f"hyperrl-agents-{unit.key}").start()
            return []
        if not self.episodic:
            sample = self._sample(unit.key)
            vision = self.task.vision(sample) if self.generator.vision else None  # a visual task's images
            prompt = tuple(self.task.encode(sample))
            return [Request(u, prompt, unit.key, vision=vision) for u in self._uids(unit)]
        sp, limits = self.generator.sampling(0), self.generator.limits()
        eps = [Episode(self.generator.make_env(), self._sample(unit.key), self.generator.tok, limits, sp.stops,
                       group_id=unit.key, uid=u, max_new_tokens=sp.max_new_tokens,
                       capabilities=self.generator.env_capabilities) for u in self._uids(unit)]
        self._unit_eps[unit.uid] = eps
        return [self._turn(unit.uid, e) for e in eps]

    def _turn(self, uid: int, ep: Episode) -> Request:
        """(under the lock) ``ep``'s next turn as a request (keyed as the synchronous round keys it)."""
        ctx, budget = ep.turn()
        q = self.generator.turn_request(ep.uid, ep.turns, ctx, budget, ep.group_id)
        self._episodes[q.uid], self._turn_limits[q.uid] = (uid, ep), budget
        return q

    def _run_agents(self, unit: A.Unit, sample) -> None:
        """(a unit's thread) Its n agent episodes as one round — never paused: a publication interrupts
        only the generation of their calls — then its rows (none when every episode failed) complete it."""
        with self._agent_slots:
            try:
                sp = self.generator.sampling(0)
                batch, stats, errors = self.generator.agent.run_unit(
                    sample, sp, self._uids(unit), group_id=unit.key,
                    submit=functools.partial(self._submit, unit.key))
            except BaseException as e:  # noqa: BLE001 — the learner fails the step naming it
                with self._cond:
                    self._errors["agent programs"] = e
                    self._cond.notify_all()
                return
        with self._cond:
            try:
                for k, v in stats.items():
                    self._agent_stats[k] = self._agent_stats.get(k, 0.0) + v
                if errors:
                    self._agent_error = errors[0]
                if unit.uid not in self._units:
                    return  # the unit was dropped meanwhile (a resume)
                self._rows[unit.uid] = [] if batch is None else [batch]
                self._complete(unit.uid)
                self._top_up()
            except BaseException as e:  # noqa: BLE001 — never lost: the learner reports it
                self._errors["agent programs"] = e
            finally:
                self._cond.notify_all()

    def _submit(self, key: int, reqs: list[Request], done) -> None:
        """(the gateway's dispatcher) An agent call's requests join the queue; ``done(rows)`` answers the
        call once all are generated (a publication between may interrupt and resume them)."""
        with self._cond:
            call = {"uids": [q.uid for q in reqs], "rows": {}, "done": done}
            for q in reqs:
                self._calls[q.uid], self._turn_limits[q.uid] = call, q.max_new_tokens
            self._pending.extend(dataclasses.replace(q, group_id=key) for q in reqs)
            self._cond.notify_all()

    def _advance(self, uid: int, ep: Episode, args) -> None:
        """(an environment thread) The turn's action to the episode's environment, outside the lock (a
        step may wait on a tool); then its next turn waits for a worker — or the episode is over, and
        with its unit's last one the unit is complete."""
        try:
            ep.advance(*args)
        except BaseException as e:  # noqa: BLE001 — the learner fails the step naming the environment
            with self._cond:
                self._stepping -= 1
                self._errors[f"environment {type(ep.env).__name__}"] = RuntimeError(
                    f"step of episode {ep.uid} raised {type(e).__name__}: {e}")
                self._cond.notify_all()
            return
        with self._cond:
            try:
                self._stepping -= 1
                self._progress += 1
                if self._unit_eps.get(uid) is None or ep not in self._unit_eps[uid]:
                    return  # the unit was dropped meanwhile (a resume): nothing to continue
                if ep.turn() is not None:
                    self._pending.insert(0, self._turn(uid, ep))  # an episode under way goes before new ones
                elif all(e.turn() is None for e in self._unit_eps[uid]):
                    self._rows[uid] = [episodes_batch(self._unit_eps.pop(uid), self.engine.pad_id)]
                    self._complete(uid)
                    self._top_up()
            except BaseException as e:  # noqa: BLE001 — never lost in a pool's future: the learner reports it
                self._errors["episode driver"] = e
            finally:
                self._cond.notify_all()

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
    def _take(self) -> tuple[list[Request], int | None, dict]:
        """(under the lock) A worker's call, by the schedule: its requests, ``stop_after`` and its log
        record (with the recorded call it replays, if any)."""
        reqs, stop_after, replayed = self.schedule.take(self)
        self._seq += 1
        record = {"call": self._seq, "version": self.engine.policy_version, "uids": [q.uid for q in reqs]}
        if replayed is not None:
            record["replayed"] = replayed
        return reqs, stop_after, record

    def _work(self, w) -> None:
        try:
            if self.threads:  # torch's intra-op threads are per calling thread: the worker's own count
                torch.set_num_threads(self.threads)
            sp = dataclasses.replace(self.generator.sampling(0), seed=self.seed * 7919)  # SyncTrainer's keyed seed
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or (not self._paused and self.schedule.can_take(self)
                                                               and not (self._lockstep and self._stepping)))
                    if self._stop:
                        return
                    reqs, stop_after, record = self._take()
                    if self._lockstep:  # the synchronous round's order: by prompt, then sample
                        reqs.sort(key=lambda q: (q.group_id, self._episodes[q.uid][1].uid))
                    self._busy.add(w.name)
                try:  # busy until the rows are delivered (or the worker restarted): a publication waits
                    try:
                        out, steps = w.generate_requests(reqs, sp, stop_after)
                    except WorkerDied:  # its requests came back to nobody: they wait again, unchanged
                        with self._cond:
                            self._pending = reqs + self._pending
                            self.schedule.died(record.get("replayed"))
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
        """Finished rows go to their unit (complete when all n are in) — multi-turn, to their episode's
        environment; aborted rows resume."""
        done = out[out["finish_reason"] != _ABORTED]
        with self._cond:
            resumed = resume_requests(out, self._turn_limits)
            record.pop("replayed", None)
            self._record(record)
            self._progress += 1
            if self.episodic:
                for i in range(done.batch_size[0]):
                    uid, ep = self._episodes.pop(int(done["sample_uid"][i]))
                    self._turn_limits.pop(int(done["sample_uid"][i]))
                    m = done["action_mask"][i]
                    args = (done["tokens"][i][m].tolist(), done["rollout_logprobs"][i][m].tolist(),
                            done["token_version"][i][m].tolist(),
                            done["routed_experts"][i] if "routed_experts" in done.keys() else None)
                    self._by[uid].add(name)
                    self._stepping += 1
                    self._steps.submit(self._advance, uid, ep, args)
                done = done[:0]
            if self.agentic:
                for i in range(done.batch_size[0]):
                    q = int(done["sample_uid"][i])
                    call = self._calls.pop(q)
                    self._turn_limits.pop(q)
                    call["rows"][q] = done[i:i + 1]
                    if len(call["rows"]) == len(call["uids"]):
                        call["done"](cat_batches([call["rows"][u] for u in call["uids"]], self.engine.pad_id))
                done = done[:0]
            unit_of = {u.key: u.uid for u in self._units.values()}
            for i in range(done.batch_size[0]):
                uid = unit_of[int(done["group_id"][i])]
                self._rows[uid].append(done[i:i + 1])
                self._by[uid].add(name)
                if len(self._rows[uid]) == self.rollout.n:
                    self._complete(uid)
            self._pending = resumed + self._pending
            self._top_up()
            self._cond.notify_all()

    def _complete(self, uid: int) -> None:
        if not self._rows[uid]:  # agents: every episode failed or never called the model (counted)
            self.buffer = A.complete(self.buffer, uid)
            return
        rows = cat_batches(self._rows[uid], self.engine.pad_id)
        rows = rows[torch.argsort(rows["sample_uid"])]  # the unit's rows in uid order, whichever worker came first
        want = sorted(self._uids(self._units[uid]))
        try:  # the workers' contract: versions stamped, the unit's own uids, each once
            validate(rows)
            got = rows["sample_uid"].tolist()
            if self.agentic and not set(got) <= set(want):  # an agent's episode may leave several rows
                raise TrajectoryError(f"sample_uid: {sorted(set(got) - set(want))} are not this group's {want}")
            if not self.agentic and sorted(got) != want:
                raise TrajectoryError(f"sample_uid: {sorted(got)}, expected {want}")
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
            if name.startswith("environment"):
                raise WorkerError(f"{name}: {e}") from e
            raise WorkerError(f"{name} died: {type(e).__name__}: {e}") from e
        for t in self._threads:
            if not t.is_alive():
                raise WorkerError(f"{t.name} is not running")

    def _wait(self, pred, what: str) -> None:
        """Wait (under the lock) for ``pred``; ``timeout_s`` bounds a period without progress (no group
        finished or started), not the whole wait — a large batch that keeps arriving never times out,
        a dead or stuck worker is an error."""
        deadline = time.monotonic() + self.timeout_s
        seen = (self.buffer.ready, self.buffer.in_flight, self._progress)
        while not pred():
            self._check_workers()
            now = (self.buffer.ready, self.buffer.in_flight, self._progress)
            if now != seen:  # progress: the deadline starts again
                seen, deadline = now, time.monotonic() + self.timeout_s
            left = deadline - time.monotonic()
            if left <= 0:
                who = ", ".join(sorted(self._busy)) or ", ".join(w.name for w in self.workers)
                raise WorkerError(f"{who}: no progress in {self.timeout_s:g} s while {what} "
                                  f"(in flight {self.buffer.in_flight}, ready {self.buffer.ready}); still serving "
                                  f"version {self.engine.policy_version}")
            self._cond.wait(min(left, 1.0))

    def collect(self, step: int, version: int, timer: Timer) -> Collected:
        """The earliest-deadline units ready at the learner's ``version`` (waiting, with the deadline,
        until there are enough), validated against η, scored and shaped."""
        self.version, self.step_idx = version, step
        taken = []
        with timer("wait"), self._cond:
            self._top_up()

            keys = self.schedule.batch_keys(self.step_idx)

            def ready():
                self.buffer, got = A.take_batch(self.buffer, self.version) if keys is None else \
                    A.take_units(self.buffer, keys)
                if got is not None:
                    taken.extend(got)
                return got is not None

            self._wait(ready, f"waiting for a batch at version {self.version}")
            self._record({"take": self.step_idx, "keys": [u.key for u in taken]})
            rows = [r for u in taken for r in self._rows.pop(u.uid)]
            for u in taken:
                self._units.pop(u.uid)
                self._by.pop(u.uid)
            self._prune_draws()
            A.check_conservation(self.buffer)
            counters = {"async_admitted": self.buffer.admitted, "async_consumed": self.buffer.consumed,
                        "async_evicted": self.buffer.evicted, "async_in_flight": self.buffer.in_flight,
                        "async_ready": self.buffer.ready, "async_restarts": self._restarts()}
        if not rows:  # agents: no episode of the step's groups left a row
            raise AgentError(f"no agent episode of step {self.step_idx}'s {len(taken)} groups produced a row"
                             + (f"; the last failure: {self._agent_error}" if self._agent_error else ""))
        batch = cat_batches(rows, self.engine.pad_id)
        validate(batch, learner_version=self.version, max_staleness=self.eta)  # every token within η
        samples = {u.key: self._sample(u.key) for u in taken}
        with timer("reward"):
            batch = score_and_shape(batch, samples, self.scorer, self.pipeline)
        st = T.staleness_metrics(batch["token_version"], batch["action_mask"], self.version, self.eta)
        with self._cond:
            agents, self._agent_stats = self._agent_stats, {}  # the agent rounds finished since the last step
        return Collected(batch, {**counters, **agents, **{k: float(v) for k, v in st.items()}}, samples)

    def _pause(self, what: str, *, drain: bool = True) -> None:
        """Stop the workers taking requests and wait (deadline) until none is generating. Free: the
        running generations are interrupted (their rows resume later). Gated: nothing is
        interrupted — the pause waits until every admitted request is generated, so each batch
        comes from exactly one version. Replay (``drain``: before a publication): the log's calls at
        this version run first, each stopping where the recorded one was interrupted."""
        with self._cond:
            try:
                self.schedule.drain(self, what, drain)
                self._paused = True
                if self.keep_kv:  # park every running generation at its next step, its cache kept
                    for w in self.workers:
                        w.hold(self._notify)
                    self._wait(lambda: all(w.parked or w.name not in self._busy for w in self.workers), what)
                    return
                if self.schedule.interrupts:
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
            with self._cond:
                self.version = self.engine.policy_version
                self._unpause()

    def _restarts(self) -> int:
        """Worker restarts so far: each worker's own count where it keeps one (a Ray worker counts every
        restart — those of a publication's commit too), else the ones this collector made."""
        counts = [w.restarts for w in self.workers if w.restarts is not None]
        return max(sum(counts), self.restarts) if counts else self.restarts

    def stop_workers(self) -> None:
        """Stop the driver threads (the workers and the engine stay as they are)."""
        with self._cond:
            self._stop = True
            for w in self.workers:
                w.interrupt()
            self._cond.notify_all()
        for t in self._threads:  # interrupted, a thread ends at its next decode step: wait for it (a thread
            t.join(timeout=max(self.timeout_s, 60.0))  # left inside torch at exit aborts the process: SIGABRT)

    def close(self) -> None:
        """Stop the driver threads and release the workers (Ray actors, a Ray started for the run); the
        environments' steps under way finish on their own (none is waited for)."""
        self.stop_workers()
        if self._steps is not None:
            self._steps.shutdown(wait=False, cancel_futures=True)
        self.executor.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 — interpreter shutdown
            pass

    def state(self) -> dict:
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

    def load_state(self, state: dict) -> None:
        """The buffer of a checkpoint (:meth:`state`): its prompts are admitted again first."""
        st = state.get("async")
        if st is None:
            raise ValueError("resume: the checkpoint was written by a synchronous run (no async state); resume it "
                             "with async.max_staleness: null or start a new out_dir")
        with self._cond:
            b = self.buffer
            self.buffer = A.Buffer(b.eta, b.batch, b.max_concurrent, (), st["consumed"] + st["evicted"],
                                   st["consumed"], st["evicted"], tuple(tuple(e) for e in st["evictions"]))
            self._units, self._rows, self._by, self._pending = {}, {}, {}, []
            self._episodes, self._unit_eps, self._turn_limits = {}, {}, {}  # their episodes start again
            self._calls = {}
            self._requeue, self._next_key = list(st["live"]), st["next_key"]
            self._record({"resume": st.get("step", None)})
