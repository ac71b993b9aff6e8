"""Generation rounds: the sampling parameters of a round and the call that makes its rows.

:class:`Generator` is what every collector and the evaluator call to turn prompts into a
trajectory batch: the round's sampling parameters and the engine, the kind of rollout being the run's
:class:`~hyperrl.loop.drivers.Driver`'s — single-turn through the engine (keyed by ``sample_uid`` on an
engine whose ``capabilities.keyed`` is set, so a synchronous run agrees with an asynchronous one at
η = 0), multi-turn through the environment (:func:`hyperrl.envs.run_episodes`), or by an agent that owns
its loop behind the gateway (:class:`hyperrl.agents.AgentEnvironment`).
"""

from __future__ import annotations

from tensordict import TensorDict

from hyperrl.loop.drivers import Driver, PlainDriver
from hyperrl.rollout.requests import Request, call_key
from hyperrl.sampling import SamplingParams

__all__ = ["Generator", "stop_ids_of"]


def stop_ids_of(policy) -> tuple[int, ...]:
    """The token ids that end a turn besides ``eos_token`` (a chat model's ``generation_config``
    may list several); () when it lists none."""
    gen_eos = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    return tuple(int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else
                                  ([gen_eos] if gen_eos is not None else [])))


class Generator:
    """Prompts → rows. ``rollout`` is the config's ``rollout`` section (read: max_new_tokens,
    temperature, top_p, top_k, max_turns, max_obs_tokens, max_episode_tokens); ``seed`` the run's;
    ``driver`` the kind of rollout (:func:`~hyperrl.loop.drivers.make_driver`; default plain — closed
    with the generator: an agent's gateway); ``toolbox`` the run's ``tools:`` (closed with it);
    ``vision``: the task's samples carry images (``task.vision(sample)``: a task declaring ``takes_images``,
    built with the model's image processor)."""

    def __init__(self, engine, task, tokenizer, rollout, *, seed: int, stop_ids: tuple[int, ...] = (),
                 driver: Driver | None = None, toolbox=None, vision: bool = False):
        self.engine, self.task, self.tok, self.rollout = engine, task, tokenizer, rollout
        self.seed, self.stop_ids, self.driver = seed, tuple(stop_ids), driver or PlainDriver()
        self.vision = vision
        self.toolbox = toolbox
        self.stats: dict[str, float] = {}

    def pop_stats(self) -> dict[str, float]:
        """The agent rounds' counts since the last call (``agent_*``: episodes, failed, empty, calls …), summed, and
        the engine's own statistics where it keeps them (vLLM's scheduler: ``engine_*``)."""
        out, self.stats = self.stats, {}
        return {**out, **self.engine.pop_stats()} if self.engine.capabilities.stats else out

    def add_stats(self, stats: dict[str, float]) -> None:
        """Add an agent round's counts to those :meth:`pop_stats` returns."""
        for k, v in stats.items():
            self.stats[k] = self.stats.get(k, 0.0) + v

    def cancel(self, reason: str) -> None:
        """End the round under way (the driver's :meth:`~hyperrl.loop.drivers.Driver.cancel`)."""
        self.driver.cancel(reason)

    def close(self) -> None:
        """Stop the driver's agent gateway and the run's MCP servers (if any)."""
        try:
            self.driver.close()
        finally:
            if self.toolbox is not None:
                self.toolbox.close()

    def limits(self):
        """The episode limits of ``rollout`` (max_turns, max_obs_tokens, max_episode_tokens)."""
        from hyperrl.envs import Limits

        r = self.rollout
        return Limits(max_turns=r.max_turns, max_obs_tokens=r.max_obs_tokens, max_episode_tokens=r.max_episode_tokens)

    @staticmethod
    def turn_request(uid: int, turn: int, context, max_new_tokens: int, group_id: int) -> Request:
        """Turn ``turn`` of episode ``uid`` as a request: keyed by ``call_key(uid, turn)``, within the
        episode's budget — the same request in a synchronous round and from an asynchronous driver."""
        return Request(call_key(uid, turn), tuple(context), group_id, max_new_tokens=max_new_tokens)

    def generate_turns(self, sampling: SamplingParams, calls, turn: int) -> TensorDict:
        """One turn of every episode in ``calls`` (``(uid, context, max_new_tokens, group id)``) on the keyed engine."""
        return self.engine.generate_requests([self.turn_request(u, turn, c, m, g) for u, c, m, g in calls], sampling)

    def sampling(self, step: int, seed_offset: int = 0, temperature: float | None = None) -> SamplingParams:
        """The sampling parameters of a round of ``step`` (seed ``seed·7919 + step + seed_offset``)."""
        r = self.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature or r.temperature,
                              top_p=r.top_p, top_k=r.top_k, eos_id=self.tok.eos_token_id, stop_ids=self.stop_ids,
                              seed=self.seed * 7919 + step + seed_offset)

    def generate(self, samples, sampling: SamplingParams, n: int, group_offset: int = 0, *,
                 uids: list[int] | None = None, step: int = 0) -> TensorDict:
        """Rollout of ``n`` samples per prompt (``[len(samples)·n]`` rows; group ids from
        ``group_offset``). Training rounds (``uids`` given) on a keyed engine sample keyed by
        (``sampling.seed − step``: the step enters through the uid, sample_uid, token index);
        the kind of rollout is the driver's (:meth:`~hyperrl.loop.drivers.Driver.generate`)."""
        return self.driver.generate(self, samples, sampling, n, group_offset, uids, step)
