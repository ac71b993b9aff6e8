"""Scoring a batch: every reward on every completion, decoded once, and the per-token credit.

:class:`Scorer` turns a generated batch into ``reward_components [B, K]`` (the environment's
episode reward first in multi-turn runs, then one column per configured reward; 0 where a reward
does not apply), ``reward_applicable [B, K]`` and ``reward [B]`` = their weighted sum — plus
``token_rewards [B, T]`` when the pipeline needs per-token credit. A verl dict reward's extra keys
are kept as metrics until :meth:`Scorer.pop_extra`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from hyperrl.rewards import Reward, RewardError, RewardSet
from hyperrl.rewards.scoring import Pending
from hyperrl.tokenizer import decode_response, decode_responses

__all__ = ["Scorer", "Scoring"]


@dataclass(frozen=True)
class Scoring:
    """Rows whose scoring :meth:`Scorer.submit` started: the rewards' pending calls (None: no configured
    rewards) and the rows' ``sample_uid`` (checked against the batch they are collected into); ``t0``: when."""

    pending: Pending | None
    uids: torch.Tensor | None
    t0: float = field(default_factory=time.perf_counter)


class Scorer:
    """``rewards``: the config's rewards (a :class:`RewardSet`), None = the task's named rewards
    (hyperrl style) — or, in a multi-turn run (``multi_turn``), the environment's episode reward
    alone. ``token_rewards``: also produce the per-token split."""

    def __init__(self, tokenizer, task, *, rewards: RewardSet | None = None, multi_turn: bool = False,
                 stop_ids: tuple[int, ...] = (), token_rewards: bool = False):
        self.tok, self.task, self.multi_turn, self.stop_ids = tokenizer, task, multi_turn, stop_ids
        self.want_token_rewards, self._rewards = token_rewards, rewards
        self._extra: dict[str, float] = {}

    @property
    def reward_set(self) -> RewardSet | None:
        """The rewards scored on each completion: the config's, else the task's named rewards (read
        each time: a task's rewards may be replaced); None in a multi-turn run without configured
        rewards (the environment's episode reward alone)."""
        if self._rewards is not None:
            return self._rewards
        if self.multi_turn:
            return None
        return RewardSet(tuple(Reward(name, fn, "hyperrl") for name, fn in self.task.rewards))

    @property
    def names(self) -> tuple[str, ...]:
        """The columns of ``reward_components``: ``env`` first in multi-turn runs, then each reward."""
        rs = self.reward_set
        return (("env",) if self.multi_turn else ()) + (rs.names if rs is not None else ())

    def close(self) -> None:
        """Release the configured rewards' threads and worker processes."""
        if self._rewards is not None:
            self._rewards.close()

    def pop_extra(self) -> dict[str, float]:
        """The extra metrics scored since the last call (a verl dict reward's other keys)."""
        out, self._extra = self._extra, {}
        return out

    @property
    def overlaps(self) -> bool:
        """Every configured reward runs off the caller's thread (pooled or async): scoring can start as rows finish,
        from any thread, without blocking it."""
        rs = self.reward_set
        return rs is not None and rs.overlaps

    def _inputs(self, batch: TensorDict, samples) -> tuple[list, list, list[str]]:
        """Each row's response ids (every action token — or, with ``final_turn``, the final response's), its
        sample, and its decoded text (each distinct response decoded once: a group often repeats one; none
        without configured rewards)."""
        act = batch["action_mask"].bool()
        if "final_turn" in batch.keys():  # the final response's tokens only
            act = act & (torch.arange(act.shape[1])[None, :] >= batch["final_turn"][:, None])
        flat, ends = batch["tokens"][act].tolist(), act.sum(-1).cumsum(0).tolist()
        ids = [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        rows = [samples[g] for g in batch["group_id"].tolist()]
        if self.reward_set is None or not ids:
            return ids, rows, []
        distinct = list(dict.fromkeys(map(tuple, ids)))
        seen = dict(zip(distinct, decode_responses(self.tok, distinct, self.stop_ids)))
        return ids, rows, [seen[tuple(i)] for i in ids]

    def submit(self, batch: TensorDict, samples) -> Scoring:
        """Start scoring ``batch``'s rows now (:meth:`score` with ``ready=`` collects them): a group scored as
        soon as it finished, its calls running while the rest is generated."""
        rs = self.reward_set
        ids, rows, texts = self._inputs(batch, samples)
        pending = rs.submit([s.prompt for s in rows], texts, ids, rows) if rs is not None else None
        return Scoring(pending, batch["sample_uid"].clone() if "sample_uid" in batch.keys() else None)

    def score(self, batch: TensorDict, samples, ready: list[Scoring] | None = None) -> TensorDict:
        """A new batch with ``reward_components``, ``reward_applicable``, ``reward`` (and
        ``token_rewards``); ``samples[g]`` is group g's sample. The rewards read every action token
        of a row — or, when the batch has ``final_turn`` (an agent's rows, a ``tool_chat`` episode),
        the final response's. ``ready``: the rows' scoring already :meth:`submit` ted, part by part in
        row order (the same values as scoring them now)."""
        ids, rows, texts = self._inputs(batch, samples)
        comps, app = [], []
        if self.multi_turn:
            comps.append(batch["reward"].float()[:, None])
            app.append(torch.ones(len(ids), 1, dtype=torch.bool))
        rs = self.reward_set
        if rs is not None:
            if ready is None:
                pendings = [rs.submit([s.prompt for s in rows], texts, ids, rows)]
            else:
                if "sample_uid" in batch.keys() and not torch.equal(
                        torch.cat([h.uids for h in ready]), batch["sample_uid"]):
                    raise RuntimeError("Scorer.score: the submitted scorings are not the batch's rows in order")
                pendings = [h.pending for h in ready]
            try:
                c, a, extra = rs.collect(*pendings)
            except RewardError as e:  # name the row as the run knows it: its sample_uid and prompt
                if e.row is None:
                    raise
                uid = int(batch["sample_uid"][e.row]) if "sample_uid" in batch.keys() else None
                src = rows[e.row].source  # every sample kind says where it came from
                raise RewardError(f"{e} (sample_uid {uid}" + (f", prompt {src}" if src else "") + ")",
                                  row=e.row) from e
            comps.append(c)
            app.append(a)
            self._extra.update(extra)
        comps, app = torch.cat(comps, -1), torch.cat(app, -1)
        total = (comps * self._weights()).sum(-1)
        out = batch.copy().set("reward_components", comps).set("reward_applicable", app).set("reward", total)
        if self.want_token_rewards:
            out.set("token_rewards", self._token_rewards(batch, ids, rows, comps, app))
        return out

    def clipped(self, batch: TensorDict) -> torch.Tensor:
        """``[B]`` bool: rows whose last action token is not a stop (EOS or a stop id) — the response
        ran into ``rollout.max_new_tokens`` (or the episode's token budget) instead of ending."""
        m = batch["action_mask"].bool()
        if m.shape[1] == 0:
            return torch.zeros(m.shape[0], dtype=torch.bool)
        pos = torch.arange(m.shape[1]).expand_as(m)
        last = torch.where(m, pos, -1).max(-1).values
        tok = batch["tokens"].gather(1, last.clamp(min=0)[:, None])[:, 0]
        stops = torch.tensor(sorted({*self.stop_ids} | ({self.tok.eos_token_id} if self.tok.eos_token_id is not None
                                                         else set())), dtype=tok.dtype)
        return (last >= 0) & ~torch.isin(tok, stops)

    def _weights(self) -> torch.Tensor:
        """``[K]``: the weight of each column of ``reward_components`` (the episode reward's is 1)."""
        rs = self.reward_set
        return torch.cat(([torch.ones(1)] if self.multi_turn else []) + ([rs.weights] if rs is not None else []))

    def raw_reward(self, batch: TensorDict) -> torch.Tensor:
        """``[B]``: the weighted sum of ``reward_components`` — the reward before any shaping."""
        return (batch["reward_components"] * self._weights()).sum(-1)

    def _token_rewards(self, batch: TensorDict, ids: list[list[int]], rows: list, comps, app) -> torch.Tensor:
        """``token_rewards`` ``[B, T]`` on the action tokens (:meth:`RewardSet.token_rewards`);
        they sum to each row's ``reward``."""
        stops = {self.tok.eos_token_id, *self.stop_ids}
        pieces = [[None if t in stops else decode_response(self.tok, [t]) for t in row] for row in ids]
        credit = self.reward_set.token_rewards(pieces, rows, comps, app)
        out = torch.zeros(batch["action_mask"].shape, dtype=torch.float32)
        m = batch["action_mask"].bool()
        out[m] = torch.tensor([v for row in credit for v in row], dtype=torch.float32)
        return out
