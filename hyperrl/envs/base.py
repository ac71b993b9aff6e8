"""Environments (framework-driven, multi-turn) and agent programs (the user owns the loop).

Token-first: the policy's tokens go into the trajectory exactly as sampled (the environment only
*reads* their decoded text); observation / tool tokens are encoded once by the tokenizer and
appended as context with action mask 0 and log-prob 0 — never part of the loss, never
re-tokenised between turns. An environment that speaks chat (``reset`` returns messages, ``step``
returns ``tool``-role messages, ``env.tools`` lists the tool schemas) gets its prompt and every
observation from the model's chat template (:func:`hyperrl.tokenizer.observation_ids`: the
template's own separators at each assistant → tool → assistant boundary); a text observation is
appended as its tokens. Limits: ``max_turns``, ``max_obs_tokens`` (text observations are
truncated; a chat observation that does not fit ends the episode, since a cut would drop the
next generation prompt), ``max_episode_tokens`` (the episode stops when its budget is spent).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from hyperrl.registry import Registry
from hyperrl.sampling import SamplingParams
from hyperrl.tokenizer import decode_response, encode_prompt, encode_text, observation_ids
from hyperrl.trajectory import NO_VERSION, stack_episodes

__all__ = ["Environment", "EnvCapabilities", "StepResult", "ENVIRONMENTS", "register_environment", "AgentProgram",
           "EpisodeBuilder", "Limits", "Episode", "episodes_batch", "run_episodes", "stack_episodes"]


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Environment.step` returns: the ``observation`` to append, the step's ``reward`` (summed over
    the episode), ``done`` (the episode ends) and ``info`` (e.g. ``tool_calls``, ``success``; see
    :class:`Environment`)."""

    observation: str | list  # text appended as context (mask 0), or tool-role messages; "" / [] for none
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EnvCapabilities:
    """What an environment does beyond ``reset`` / ``step`` — declared where it registers
    (``register_environment(name, capabilities=EnvCapabilities(...))``), never probed on the built object:

    * ``reports_success`` — the step that ends an episode carries ``info["success"]``; its batches then carry
      ``success`` ``[B]`` (0 for an episode cut by a limit before it ended);
    * ``takes_tools`` — built with the run's tools (``tools:``, MCP servers) as its first argument;
    * ``scores_final_turn`` — the configured rewards judge the final response (rows carry ``final_turn``);
    * ``owns_loop`` — an agent that runs its own loop behind the gateway (``bind`` / ``close``), not turn by turn.
    """

    reports_success: bool = False
    takes_tools: bool = False
    scores_final_turn: bool = False
    owns_loop: bool = False


@runtime_checkable
class Environment(Protocol):
    """``step``'s ``info`` may carry ``tool_calls`` (calls made this step: the tool-call rate) and,
    on the step that ends the episode, ``success`` (the task solved, whatever reward shaping adds:
    the held-out success rate) — for an environment registered with
    ``capabilities=EnvCapabilities(reports_success=True)`` (:class:`EnvCapabilities`). An optional ``tools``
    member holds the tool schemas the chat template renders in the first prompt (None: none)."""

    def reset(self, sample: Any) -> str | list:
        """Start an episode; returns the initial prompt text or chat messages."""

    def step(self, action: str) -> StepResult:
        """React to the policy's decoded action text."""


ENVIRONMENTS: Registry = Registry("environment", capabilities=EnvCapabilities())
_CAPABILITY_ATTRS = ("reports_success", "takes_tools", "scores_final_turn", "owns_loop")


def register_environment(name: str, *, capabilities: EnvCapabilities | None = None, **kw):
    """Decorator: register an environment factory (a class or a function ``(**hyperparams) -> env``) under ``name``
    with what it can do (:class:`EnvCapabilities`; none declared: none). A class still carrying an earlier
    release's capability attribute (``reports_success = True``, …) is refused naming the declaration to write, so a
    capability is never silently lost."""
    def deco(fn):
        old = [a for a in _CAPABILITY_ATTRS if a in vars(fn)] if isinstance(fn, type) else []
        if old:
            raise TypeError(f"environment {name!r}: declare {', '.join(old)} at registration — "
                            f"register_environment({name!r}, capabilities=EnvCapabilities("
                            f"{', '.join(f'{a}=True' for a in old)})) — not as class attributes")
        return ENVIRONMENTS.register(name, capabilities=capabilities, **kw)(fn)

    return deco


@runtime_checkable
class AgentProgram(Protocol):
    """The user owns the loop: given an engine and a sample, return a one-row trajectory
    (build it with :class:`EpisodeBuilder`)."""

    def __call__(self, engine, sample: Any) -> TensorDict: ...


@dataclass(frozen=True)
class Limits:
    """An episode's limits (see the module doc): at most ``max_turns`` policy turns, ``max_obs_tokens`` per
    observation, ``max_episode_tokens`` in all (prompt, actions and observations)."""

    max_turns: int = 4
    max_obs_tokens: int = 64
    max_episode_tokens: int = 256


class EpisodeBuilder:
    """Accumulate one episode's tokens segment by segment, then emit a trajectory row."""

    def __init__(self, prompt_ids: list[int]):
        if not prompt_ids:
            raise ValueError("prompt_ids: an episode starts with at least one prompt token")
        self.tokens = list(prompt_ids)
        self.action = [False] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.segments: list[tuple[str, int, int]] = [("prompt", 0, len(prompt_ids))]

    def add_action(self, ids: list[int], logprobs: list[float]) -> EpisodeBuilder:
        if len(ids) != len(logprobs):
            raise ValueError(f"action: {len(ids)} tokens but {len(logprobs)} log-probs")
        self._add("action", ids, True, logprobs)
        return self

    def add_observation(self, ids: list[int]) -> EpisodeBuilder:
        self._add("observation", ids, False, [0.0] * len(ids))
        return self

    def _add(self, kind, ids, is_action, lps):
        start = len(self.tokens)
        self.tokens += list(ids)
        self.action += [is_action] * len(ids)
        self.logprobs += list(lps)
        self.segments.append((kind, start, len(self.tokens)))

    def __len__(self) -> int:
        return len(self.tokens)

    def row(self, *, reward: float, group_id: int, version: int) -> dict:
        return dict(tokens=self.tokens, action=self.action, logprobs=self.logprobs, reward=reward,
                    group_id=group_id, version=version)


class Episode:
    """One episode of an environment as a state machine its driver steps — synchronously
    (:func:`run_episodes`: every active episode's turn in one batch) or one turn at a time as its
    requests come back (the asynchronous collector). :meth:`turn` is the next call to make —
    ``(context ids, max_new_tokens)``, the budget the episode has left — or None once the episode is
    over; :meth:`advance` takes the turn's sampled action (ids, log-probs, the version of each
    token), steps the environment on its decoded text and appends the observation (module doc).
    ``stops``: the ids that end a turn (decoding cuts there); ``uid``: the episode's sample_uid."""

    def __init__(self, env, sample, tokenizer, limits: Limits, stops: tuple[int, ...] = (), *, group_id: int = 0,
                 uid: int | None = None, max_new_tokens: int = 1 << 30,
                 capabilities: EnvCapabilities = EnvCapabilities()):
        self.env, self.tok, self.limits, self.stops = env, tokenizer, limits, tuple(stops)
        self.group_id, self.uid, self.max_new_tokens = group_id, uid, max_new_tokens
        self.capabilities = capabilities  # the environment's, as registered
        first = env.reset(sample)
        self.tools = getattr(env, "tools", None)  # optional member: tool schemas the chat template renders
        self.builder = EpisodeBuilder(encode_prompt(tokenizer, first, tools=self.tools))
        self.chat = list(first) if isinstance(first, list) else None  # the conversation so far
        self.versions: list[int] = [NO_VERSION] * len(self.builder)
        self.reward, self.calls, self.success, self.turns, self.done = 0.0, 0, False, 0, False
        self.routes: torch.Tensor | None = None  # a mixture of experts: each token's first recorded route
        self._routes_lost = False  # a turn came without routes: the row carries none

    def turn(self) -> tuple[list[int], int] | None:
        """The next call: the context to continue and its token budget; None when the episode is over."""
        if self.done or self.turns >= self.limits.max_turns or len(self.builder) >= self.limits.max_episode_tokens:
            return None
        return self.builder.tokens, max(1, min(self.max_new_tokens, self.limits.max_episode_tokens - len(self.builder)))

    def _take_routes(self, routes: torch.Tensor | None, n: int) -> None:
        """The turn's routes ``[context + n, L, k]``: the context's tokens keep the routes they were first
        recorded with (an observation gets its from this turn's prefill), the action's are appended."""
        if routes is None or self._routes_lost:
            self._routes_lost, self.routes = True, None
            return
        ctx = len(self.builder)
        if self.routes is None:
            self.routes = torch.full((ctx, *routes.shape[1:]), -1, dtype=torch.int16)
        have = self.routes[:ctx]
        have = torch.where((have >= 0).all(-1, keepdim=True), have, routes[:ctx].to(torch.int16))
        self.routes = torch.cat([have, routes[ctx:ctx + n].to(torch.int16)])

    def advance(self, ids: list[int], logprobs: list[float], versions: list[int],
                routes: torch.Tensor | None = None) -> None:
        """The turn's action → the environment's step → its observation appended (or the episode ends).
        ``routes``: a mixture of experts' ``routed_experts`` of the turn's row (context + action)."""
        b, lim = self.builder, self.limits
        self._take_routes(routes, len(ids))
        b.add_action(ids, logprobs)
        self.versions += list(versions)
        self.turns += 1
        text = decode_response(self.tok, ids, self.stops)
        res = self.env.step(text)
        self.reward += float(res.reward)
        info = res.info or {}
        self.calls += int(info.get("tool_calls", 0))
        self.success = bool(info.get("success", self.success))
        room = min(lim.max_obs_tokens, lim.max_episode_tokens - len(b))
        self.done = res.done
        if res.observation and not self.done and room > 0:
            if isinstance(res.observation, str):  # text: truncated to the budget
                obs = encode_text(self.tok, res.observation)[:room]
            elif self.chat is None:
                raise TypeError(f"{type(self.env).__name__}.step returned chat messages but reset returned text; "
                                "a chat environment's reset must return messages")
            else:  # chat: the template's tokens whole (a cut would drop the generation prompt), or stop
                self.chat.append({"role": "assistant", "content": text})
                obs = observation_ids(self.tok, self.chat, ids, res.observation, tools=self.tools)
                self.chat.extend(res.observation)
                if len(obs) > room:
                    self.done, obs = True, []
            if obs:
                b.add_observation(obs)
                self.versions += [NO_VERSION] * len(obs)
                if self.routes is not None:  # routed by the next turn's prefill
                    self.routes = torch.cat([self.routes, torch.full((len(obs), *self.routes.shape[1:]), -1,
                                                                     dtype=torch.int16)])

    def row(self) -> dict:
        """The episode's trajectory row (tokens, masks, log-probs, per-token versions, reward, group)."""
        acted = [v for v, a in zip(self.versions, self.builder.action) if a]
        row = {**self.builder.row(reward=self.reward, group_id=self.group_id, version=min(acted, default=0)),
               "token_versions": self.versions}
        if self.uid is not None:
            row["sample_uid"] = self.uid
        if self.routes is not None and not self._routes_lost:
            row["routes"] = self.routes
        if self.capabilities.scores_final_turn:  # the configured rewards judge the final response
            row["final_turn"] = next((s for kind, s, _ in reversed(self.builder.segments) if kind == "action"), 0)
        return row


def episodes_batch(episodes: list[Episode], pad_id: int) -> TensorDict:
    """Finished episodes → their trajectory batch: a row each, with ``tool_calls`` ``[B]``, and
    ``success`` ``[B]`` when the environment reports it."""
    batch = stack_episodes([e.row() for e in episodes], pad_id)
    batch = batch.set("tool_calls", torch.tensor([e.calls for e in episodes], dtype=torch.int64))
    if episodes and episodes[0].capabilities.reports_success:
        batch = batch.set("success", torch.tensor([float(e.success) for e in episodes], dtype=torch.float32))
    return batch


def _step_all(jobs, pool) -> None:
    """``ep.advance(*args)`` for every ``(ep, args)``: concurrently on ``pool`` (an environment's step may
    wait on a tool or a sandbox; every episode has its own environment), errors raised in order."""
    if pool is None or len(jobs) < 2:
        for ep, args in jobs:
            ep.advance(*args)
        return
    for f in [pool.submit(ep.advance, *args) for ep, args in jobs]:
        f.result()


def run_episodes(engine, make_env, samples: list, tokenizer, sampling: SamplingParams, *, n: int = 1,
                 limits: Limits = Limits(), group_offset: int = 0, uids: list[int] | None = None,
                 generate_turns=None, concurrency: int = 32, capabilities: EnvCapabilities = EnvCapabilities()
                 ) -> tuple[TensorDict, list[EpisodeBuilder]]:
    """Drive ``n`` multi-turn episodes per sample, batched across active episodes each turn.

    Each turn the engine continues every active episode from its full token context (prompt,
    earlier actions, observations) within the episode's own budget (``max_episode_tokens`` minus
    its length); the decoded action goes to ``env.step`` (the turn's steps run concurrently, up to
    ``concurrency``); its observation is encoded once, truncated to ``max_obs_tokens`` and
    appended with mask 0 (:class:`Episode`). The episode reward is the sum of step rewards;
    ``tool_calls`` ``[B]`` counts each episode's calls and, when the environment reports it,
    ``success`` ``[B]`` is its final step's. ``uids``: the episodes' sample_uids (rows carry them);
    ``generate_turns(calls, turn)``: how a turn is generated — ``calls`` are ``(uid, context ids,
    max_new_tokens, group id)`` → a ``generate_requests``-style batch, a row per call (a keyed engine's
    requests: each turn's tokens independent of the batch); None: ``engine.generate`` on the whole
    turn, budgeted by the tightest episode. ``capabilities``: the environment's, as registered
    (:class:`EnvCapabilities`). Returns the trajectory batch and the builders (their
    ``segments`` record exactly which tokens came from where).
    """
    if uids is not None and len(uids) != len(samples) * n:
        raise ValueError(f"uids: {len(uids)} for {len(samples)} samples × n={n}")
    episodes = [Episode(make_env(), s, tokenizer, limits, sampling.stops, group_id=group_offset + i,
                        uid=None if uids is None else uids[i * n + j], max_new_tokens=sampling.max_new_tokens,
                        capabilities=capabilities)
                for i, s in enumerate(samples) for j in range(n)]
    longest = max((len(e.builder) for e in episodes), default=0)
    if longest >= limits.max_episode_tokens:  # nothing could be generated: say so, never train on prompts alone
        raise ValueError(f"an episode's first prompt has {longest} tokens, which fills max_episode_tokens="
                         f"{limits.max_episode_tokens} (rollout.max_episode_tokens); raise it above the prompt "
                         f"plus {limits.max_turns} turns of responses and observations")
    version = engine.policy_version
    with ThreadPoolExecutor(max(1, min(concurrency, len(episodes)))) as pool:
        for turn in range(limits.max_turns):
            calls = [(e, e.turn()) for e in episodes]
            calls = [(e, c) for e, c in calls if c is not None]
            if not calls:
                break
            if generate_turns is not None:
                out = generate_turns([(e.uid, ctx, budget, e.group_id) for e, (ctx, budget) in calls], turn)
            else:
                sp = dataclasses.replace(sampling, max_new_tokens=min(b for _, (_, b) in calls),
                                         seed=None if sampling.seed is None else sampling.seed + turn)
                out = engine.generate([ctx for _, (ctx, _) in calls], sp, 1)
            jobs = []
            for row, (e, _) in enumerate(calls):
                m = out["action_mask"][row]
                tv = out["token_version"][row][m].tolist() if "token_version" in out.keys() else None
                ids = out["tokens"][row][m].tolist()
                routes = out["routed_experts"][row] if "routed_experts" in out.keys() else None
                jobs.append((e, (ids, out["rollout_logprobs"][row][m].tolist(), tv or [version] * len(ids), routes)))
            _step_all(jobs, pool)
    return episodes_batch(episodes, getattr(engine, "pad_id", tokenizer.pad_token_id or 0)), \
        [e.builder for e in episodes]
