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

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from hyperrl.registry import Registry
from hyperrl.sampling import SamplingParams
from hyperrl.tokenizer import decode_response, encode_prompt, encode_text, observation_ids
from hyperrl.trajectory import stack_episodes

__all__ = ["Environment", "StepResult", "ENVIRONMENTS", "register_environment", "AgentProgram", "EpisodeBuilder",
           "Limits", "run_episodes", "stack_episodes"]


@dataclass(frozen=True)
class StepResult:
    observation: str | list  # text appended as context (mask 0), or tool-role messages; "" / [] for none
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """``step``'s ``info`` may carry ``tool_calls`` (calls made this step: the tool-call rate) and,
    on the step that ends the episode, ``success`` (the task solved, whatever reward shaping adds:
    the held-out success rate). An environment that reports success sets the class attribute
    ``reports_success = True``; its batches then carry ``success`` ``[B]`` (0 for an episode cut
    by a limit before it ended)."""

    def reset(self, sample: Any) -> str | list:
        """Start an episode; returns the initial prompt text or chat messages."""

    def step(self, action: str) -> StepResult:
        """React to the policy's decoded action text."""


ENVIRONMENTS: Registry = Registry("environment")
register_environment = ENVIRONMENTS.register


@runtime_checkable
class AgentProgram(Protocol):
    """The user owns the loop: given an engine and a sample, return a one-row trajectory
    (build it with :class:`EpisodeBuilder`)."""

    def __call__(self, engine, sample: Any) -> TensorDict: ...


@dataclass(frozen=True)
class Limits:
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


def run_episodes(engine, make_env, samples: list, tokenizer, sampling: SamplingParams, *, n: int = 1,
                 limits: Limits = Limits(), group_offset: int = 0) -> tuple[TensorDict, list[EpisodeBuilder]]:
    """Drive ``n`` multi-turn episodes per sample, batched across active episodes each turn.

    Each turn the engine continues every active episode from its full token context (prompt,
    earlier actions, observations); the decoded action goes to ``env.step``; its observation is
    encoded once, truncated to ``max_obs_tokens`` and appended with mask 0. The episode reward is
    the sum of step rewards; ``tool_calls`` ``[B]`` counts each episode's calls and, when the
    environment reports it, ``success`` ``[B]`` is its final step's. Returns the trajectory batch
    and the builders (their ``segments`` record exactly which tokens came from where).
    """

    envs, builders, rewards, groups, chats, calls, wins = [], [], [], [], [], [], []
    for i, s in enumerate(samples):
        for _ in range(n):
            env = make_env()
            first = env.reset(s)
            tools = getattr(env, "tools", None)
            envs.append(env)
            builders.append(EpisodeBuilder(encode_prompt(tokenizer, first, tools=tools)))
            chats.append(list(first) if isinstance(first, list) else None)  # the conversation so far
            rewards.append(0.0)
            calls.append(0)
            wins.append(False)
            groups.append(group_offset + i)
    longest = max((len(b) for b in builders), default=0)
    if longest >= limits.max_episode_tokens:  # nothing could be generated: say so, never train on prompts alone
        raise ValueError(f"an episode's first prompt has {longest} tokens, which fills max_episode_tokens="
                         f"{limits.max_episode_tokens} (rollout.max_episode_tokens); raise it above the prompt "
                         f"plus {limits.max_turns} turns of responses and observations")
    active = [True] * len(builders)
    version = engine.policy_version
    for turn in range(limits.max_turns):
        idx = [i for i, a in enumerate(active) if a]
        if not idx:
            break
        budget = min(limits.max_episode_tokens - len(builders[i]) for i in idx)
        sp = SamplingParams(max_new_tokens=max(1, min(sampling.max_new_tokens, budget)),
                            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            eos_id=sampling.eos_id, stop_ids=sampling.stop_ids,
                            seed=None if sampling.seed is None else sampling.seed + turn)
        out = engine.generate([builders[i].tokens for i in idx], sp, 1)
        for row, i in enumerate(idx):
            m = out["action_mask"][row]
            ids = out["tokens"][row][m].tolist()
            lps = out["rollout_logprobs"][row][m].tolist()
            b = builders[i]
            b.add_action(ids, lps)
            text = decode_response(tokenizer, ids, sp.stops)
            res = envs[i].step(text)
            rewards[i] += float(res.reward)
            info = res.info or {}
            calls[i] += int(info.get("tool_calls", 0))
            wins[i] = bool(info.get("success", wins[i]))
            room = min(limits.max_obs_tokens, limits.max_episode_tokens - len(b))
            done = res.done
            if res.observation and not done and room > 0:
                if isinstance(res.observation, str):  # text: truncated to the budget
                    b.add_observation(encode_text(tokenizer, res.observation)[:room])
                elif chats[i] is None:
                    raise TypeError(f"{type(envs[i]).__name__}.step returned chat messages but reset returned text; "
                                    "a chat environment's reset must return messages")
                else:  # chat: the template's tokens whole (a cut would drop the generation prompt), or stop
                    chats[i].append({"role": "assistant", "content": text})
                    obs = observation_ids(tokenizer, chats[i], ids, res.observation, tools=getattr(envs[i], "tools",
                                                                                                    None))
                    chats[i].extend(res.observation)
                    if len(obs) <= room:
                        b.add_observation(obs)
                    else:
                        done = True
            active[i] = not done and len(b) < limits.max_episode_tokens
    rows = [b.row(reward=r, group_id=g, version=version) for b, r, g in zip(builders, rewards, groups)]
    if envs and getattr(envs[0], "scores_final_turn", False):  # the configured rewards judge the final response
        for row, b in zip(rows, builders):
            row["final_turn"] = next((s for kind, s, _ in reversed(b.segments) if kind == "action"), 0)
    batch = stack_episodes(rows, getattr(engine, "pad_id", tokenizer.pad_token_id or 0))
    batch = batch.set("tool_calls", torch.tensor(calls, dtype=torch.int64))
    if envs and getattr(envs[0], "reports_success", False):
        batch = batch.set("success", torch.tensor(wins, dtype=torch.float32))
    return batch, builders
