"""Rollout drivers: one per kind of rollout, chosen once, used by both collectors.

A rollout is **plain** (a prompt → ``n`` sampled responses), **episodes** (multi-turn: each turn a
request, each action stepped by the episode's environment) or **agent** (a program that owns its loop
and calls the model through the gateway). Each kind is one :class:`Driver` registered in
``ROLLOUT_DRIVERS``, saying for its kind

* how a synchronous round runs — :meth:`Driver.generate`, what :meth:`Generator.generate
  <hyperrl.loop.generation.Generator.generate>` calls (the synchronous collector, the evaluator);
* what an asynchronous unit (a prompt's ``n`` samples) first requests — :meth:`Driver.open`;
* what becomes of a finished row — :meth:`Driver.deliver`: a plain row is its unit's; an episode's turn
  goes to its environment (on a thread pool) and its next turn is queued ahead of new prompts; an agent's
  gateway call is answered when all its rows are in.

:func:`make_driver` chooses the kind once, from what the environment declared at registration
(:class:`~hyperrl.envs.EnvCapabilities`): none → plain, ``owns_loop`` → agent, else episodes. The
asynchronous side runs under the lock of the collector's queue (:class:`~hyperrl.loop.async_queue.AsyncQueue`,
given to :meth:`Driver.attach`); the driver keeps only what its kind adds (episodes in flight, gateway calls).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

from tensordict import TensorDict

from hyperrl.agents import AgentError
from hyperrl.envs import EnvCapabilities, Episode, episodes_batch, run_episodes
from hyperrl.registry import Registry
from hyperrl.rollout.requests import Request
from hyperrl.trajectory import TrajectoryError, cat_batches

__all__ = ["ROLLOUT_DRIVERS", "Driver", "PlainDriver", "EpisodeDriver", "AgentDriver", "make_driver"]

ROLLOUT_DRIVERS: Registry = Registry("rollout driver")


class Driver(ABC):
    """A kind of rollout (module doc). ``env``: what the kind drives (None; an environment factory; a bound
    agent); ``capabilities``: the environment's declaration. Class attributes: ``multi_turn`` (rows carry
    observations: the scorer reads the episode's rewards), ``several_rows`` (a sample may leave several rows
    — an agent's episode — or none)."""

    multi_turn = False
    several_rows = False

    def __init__(self, env=None, capabilities: EnvCapabilities | None = None):
        self.env, self.capabilities = env, capabilities or EnvCapabilities()
        self.gen = self.q = None
        self.lockstep = False

    @abstractmethod
    def generate(self, gen, samples, sampling, n: int, group_offset: int, uids, step: int) -> TensorDict:
        """A synchronous round: ``[len(samples)·n]`` rows (:meth:`~hyperrl.loop.generation.Generator.generate`)."""

    def attach(self, gen, q, *, lockstep: bool) -> None:
        """Drive an asynchronous collector's units: ``gen`` the run's generator, ``q`` its queue; ``lockstep``:
        η = 0 or gated — turns taken as the synchronous round takes them (multi-turn)."""
        self.gen, self.q, self.lockstep = gen, q, lockstep

    @abstractmethod
    def open(self, unit) -> list[Request]:
        """(under the queue's lock) A newly admitted unit's first requests."""

    def deliver(self, done: TensorDict, worker: str) -> TensorDict:
        """(under the queue's lock) Finished rows from ``worker`` → those that are their unit's rows."""
        return done

    def ready(self) -> bool:
        """May a worker take a call now (multi-turn in lockstep: not while an environment steps)."""
        return True

    def order(self, reqs: list[Request]) -> list[Request]:
        """A call's requests in the order the worker generates them."""
        return reqs

    def pop_stats(self) -> dict[str, float]:
        """The asynchronous rounds' counts since the last call (agents)."""
        return {}

    def no_rows(self, step: int, groups: int) -> Exception:
        """The error for a step whose ``groups`` left no row."""
        return TrajectoryError(f"step {step}: none of its {groups} groups left a row")

    def reset(self) -> None:
        """Forget the units in flight (a resume generates them again)."""
        return None  # a default hook: nothing to do

    def detach(self) -> None:
        """Release what :meth:`attach` started (the environments' steps under way finish on their own)."""
        return None  # a default hook: nothing to do

    def cancel(self, reason: str) -> None:
        """End the synchronous round under way now (the run was asked to stop); it raises, naming ``reason``.
        From any thread."""
        return None  # a default hook: a round without agents ends in a step's time

    def close(self) -> None:
        """Release what the driver holds (an agent's gateway)."""
        return None  # a default hook: nothing to do


@ROLLOUT_DRIVERS.register("plain")
class PlainDriver(Driver):
    """A prompt's ``n`` samples, single-turn (on a keyed engine keyed by ``sample_uid``, so a synchronous run
    agrees with an asynchronous one at η = 0); a visual task's rows carry its images."""

    def generate(self, gen, samples, sampling, n, group_offset, uids, step):
        prompts = [gen.task.encode(s) for s in samples]
        vision = [gen.task.vision(s) for s in samples] if gen.vision else None  # images: placeholders are in the ids
        if uids is not None and gen.engine.capabilities.keyed:
            reqs = [Request(u, tuple(prompts[i]), group_offset + i, vision=None if vision is None else vision[i])
                    for i, u in zip([i for i in range(len(prompts)) for _ in range(n)], uids)]
            return gen.engine.generate_requests(reqs, dataclasses.replace(sampling, seed=sampling.seed - step))
        kw = {} if vision is None else {"vision": vision}
        return gen.engine.generate(prompts, sampling, n, group_offset=group_offset, **kw)

    def open(self, unit):
        sample = self.q.sample(unit.key)
        vision = self.gen.task.vision(sample) if self.gen.vision else None
        prompt = tuple(self.gen.task.encode(sample))
        return [Request(u, prompt, unit.key, vision=vision) for u in self.q.uids(unit)]


@ROLLOUT_DRIVERS.register("episodes")
class EpisodeDriver(Driver):
    """Multi-turn episodes (:class:`~hyperrl.envs.Episode`): each turn a request keyed by ``call_key(sample_uid,
    turn)`` within the episode's budget; a finished turn goes to its environment on a thread pool (a tool's wait
    overlaps generation) and the unit completes when its episodes are over. In lockstep a call waits until no
    step is under way and takes every episode's next turn in episode order — the synchronous round's batch."""

    multi_turn = True

    def generate(self, gen, samples, sampling, n, group_offset, uids, step):
        turns = None
        if uids is not None and gen.engine.capabilities.keyed:  # each turn keyed by (sample_uid, turn)
            turns = functools.partial(gen.generate_turns, dataclasses.replace(sampling, seed=sampling.seed - step))
        batch, _ = run_episodes(gen.engine, self.env, samples, gen.tok, sampling, n=n, limits=gen.limits(),
                                group_offset=group_offset, uids=uids, generate_turns=turns,
                                concurrency=gen.rollout.max_concurrent_episodes, capabilities=self.capabilities)
        return batch

    def attach(self, gen, q, *, lockstep):
        super().attach(gen, q, lockstep=lockstep)
        self.pool = ThreadPoolExecutor(gen.rollout.max_concurrent_episodes, thread_name_prefix="hyperrl-env")
        self.stepping = 0  # environment steps under way
        self.reset()

    def reset(self):
        self.turns: dict[int, tuple[int, Episode]] = {}  # a turn request's uid → (unit uid, its episode)
        self.units: dict[int, list[Episode]] = {}  # unit uid → its n episodes

    def open(self, unit):
        g, sp = self.gen, self.gen.sampling(0)
        eps = [Episode(self.env(), self.q.sample(unit.key), g.tok, g.limits(), sp.stops, group_id=unit.key, uid=u,
                       max_new_tokens=sp.max_new_tokens, capabilities=self.capabilities) for u in self.q.uids(unit)]
        self.units[unit.uid] = eps
        return [self._turn(unit.uid, e) for e in eps]

    def _turn(self, uid: int, ep: Episode) -> Request:
        """(under the lock) ``ep``'s next turn as a request (keyed as the synchronous round keys it)."""
        ctx, budget = ep.turn()
        r = self.gen.turn_request(ep.uid, ep.turns, ctx, budget, ep.group_id)
        self.turns[r.uid], self.q.limits[r.uid] = (uid, ep), budget
        return r

    def deliver(self, done, worker):
        for i in range(done.batch_size[0]):
            request = int(done["sample_uid"][i])
            uid, ep = self.turns.pop(request)
            self.q.limits.pop(request)
            m = done["action_mask"][i]
            args = (done["tokens"][i][m].tolist(), done["rollout_logprobs"][i][m].tolist(),
                    done["token_version"][i][m].tolist(),
                    done["routed_experts"][i] if "routed_experts" in done.keys() else None)
            self.q.by[uid].add(worker)
            self.stepping += 1
            self.pool.submit(self._advance, uid, ep, args)
        return done[:0]

    def _advance(self, uid: int, ep: Episode, args) -> None:
        """(an environment thread) The turn's action to the episode's environment, outside the lock (a step may
        wait on a tool); then its next turn waits for a worker — or the episode is over, and with its unit's
        last one the unit is complete."""
        q = self.q
        try:
            ep.advance(*args)
        except BaseException as e:  # noqa: BLE001 — the learner fails the step naming the environment
            with q.cond:
                self.stepping -= 1
                q.fail(f"environment {type(ep.env).__name__}",
                       RuntimeError(f"step of episode {ep.uid} raised {type(e).__name__}: {e}"))
            return
        with q.cond:
            try:
                self.stepping -= 1
                q.progress += 1
                if self.units.get(uid) is None or ep not in self.units[uid]:
                    return  # the unit was dropped meanwhile (a resume): nothing to continue
                if ep.turn() is not None:
                    q.pending.insert(0, self._turn(uid, ep))  # an episode under way goes before new ones
                elif all(e.turn() is None for e in self.units[uid]):
                    q.rows[uid] = [episodes_batch(self.units.pop(uid), q.engine.pad_id)]
                    q.complete(uid)
                    q.top_up()
            except BaseException as e:  # noqa: BLE001 — never lost in a pool's future: the learner reports it
                q.errors["episode driver"] = e
            finally:
                q.cond.notify_all()

    def ready(self):
        return not (self.lockstep and self.stepping)

    def order(self, reqs):
        if self.lockstep:  # the synchronous round's order: by prompt, then sample
            reqs.sort(key=lambda r: (r.group_id, self.turns[r.uid][1].uid))
        return reqs

    def detach(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


@ROLLOUT_DRIVERS.register("agent")
class AgentDriver(Driver):
    """An agent program behind the gateway (:class:`~hyperrl.agents.AgentEnvironment`, bound): a unit's ``n``
    episodes run as one round on a thread of their own from admission (never paused; at most
    ``max_concurrent_episodes`` episodes at once); their gateway calls come in through :meth:`submit` as
    requests and are answered when generated — interrupted and resumed across publications like any."""

    multi_turn = several_rows = True

    @property
    def agent(self):
        """The bound agent environment."""
        return self.env

    def generate(self, gen, samples, sampling, n, group_offset, uids, step):
        if uids is not None and gen.engine.capabilities.keyed:  # keyed as the asynchronous trainer keys it
            sampling = dataclasses.replace(sampling, seed=sampling.seed - step)
        batch = self.env.run(samples, sampling, n, group_offset=group_offset, uids=uids)
        gen.add_stats(self.env.stats)
        return batch

    def attach(self, gen, q, *, lockstep):
        super().attach(gen, q, lockstep=lockstep)
        r = gen.rollout
        self.slots = threading.BoundedSemaphore(max(1, r.max_concurrent_episodes // r.n))
        self.error = ""  # the last agent failure (an all-empty batch names it)
        self.stats: dict[str, float] = {}  # the asynchronous rounds' counts since the last step
        self.reset()

    def reset(self):
        self.calls: dict[int, dict] = {}  # a gateway call's request uid → the call (its rows, its answer)

    def open(self, unit):
        threading.Thread(target=self._run, args=(unit, self.q.sample(unit.key)), daemon=True,
                         name=f"hyperrl-agents-{unit.key}").start()
        return []  # the agents call the gateway; their calls come back through submit

    def _run(self, unit, sample) -> None:
        """(a unit's thread) Its n agent episodes as one round — never paused: a publication interrupts only the
        generation of their calls — then its rows (none when every episode failed) complete it."""
        q = self.q
        with self.slots:
            try:
                batch, stats, errors = self.env.run_unit(sample, self.gen.sampling(0), q.uids(unit),
                                                         group_id=unit.key,
                                                         submit=functools.partial(self.submit, unit.key))
            except BaseException as e:  # noqa: BLE001 — the learner fails the step naming it
                with q.cond:
                    q.fail("agent programs", e)
                return
        with q.cond:
            try:
                for k, v in stats.items():
                    self.stats[k] = self.stats.get(k, 0.0) + v
                if errors:
                    self.error = errors[0]
                if unit.uid not in q.units:
                    return  # the unit was dropped meanwhile (a resume)
                q.rows[unit.uid] = [] if batch is None else [batch]
                q.complete(unit.uid)
                q.top_up()
            except BaseException as e:  # noqa: BLE001 — never lost: the learner reports it
                q.errors["agent programs"] = e
            finally:
                q.cond.notify_all()

    def submit(self, key: int, reqs: list[Request], done) -> None:
        """(the gateway's dispatcher) An agent call's requests join the queue; ``done(rows)`` answers the call
        once all are generated (a publication between may interrupt and resume them)."""
        q = self.q
        with q.cond:
            call = {"uids": [r.uid for r in reqs], "rows": {}, "done": done}
            for r in reqs:
                self.calls[r.uid], q.limits[r.uid] = call, r.max_new_tokens
            q.pending.extend(dataclasses.replace(r, group_id=key) for r in reqs)
            q.cond.notify_all()

    def deliver(self, done, worker):
        for i in range(done.batch_size[0]):
            uid = int(done["sample_uid"][i])
            call = self.calls.pop(uid)
            self.q.limits.pop(uid)
            call["rows"][uid] = done[i:i + 1]
            if len(call["rows"]) == len(call["uids"]):
                call["done"](cat_batches([call["rows"][u] for u in call["uids"]], self.q.engine.pad_id))
        return done[:0]

    def pop_stats(self):
        out, self.stats = self.stats, {}
        return out

    def no_rows(self, step, groups):
        return AgentError(f"no agent episode of step {step}'s {groups} groups produced a row"
                          + (f"; the last failure: {self.error}" if self.error else ""))

    def cancel(self, reason):
        self.env.cancel(reason)

    def close(self):
        self.env.close()


def make_driver(env=None, capabilities: EnvCapabilities | None = None) -> Driver:
    """The run's driver, chosen once from the environment's declared capabilities: no environment (``env``
    None) → ``plain``; an environment that ``owns_loop`` (``env``: the bound agent) → ``agent``; else
    ``episodes`` (``env``: the environment factory)."""
    caps = capabilities or EnvCapabilities()
    kind = "plain" if env is None else "agent" if caps.owns_loop else "episodes"
    return ROLLOUT_DRIVERS.get(kind)(env, caps)
