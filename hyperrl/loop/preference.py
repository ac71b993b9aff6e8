"""Preference training (DPO and kin, ``algo.preference``): the trainer's step over pairs instead of rollouts.

The same house as RL — one :class:`~hyperrl.loop.trainer.Trainer`, policy, reference, learner, data-parallel
strategy, publisher, checkpointer — with three pieces swapped: :class:`PairCollector` reads this rank's share
of ``rollout.prompts_per_step`` pairs from the ``preference`` task (:mod:`hyperrl.data.preference`) and lays
each out as two rows, chosen then rejected, sharing a ``group_id`` (the pair) and the same prompt ids; the
pipeline's one loss term is ``preference`` (:mod:`hyperrl.algorithms.terms`: the reference's log-probs come from
the ``ref_logprobs`` key provider once per batch; the term sums each row's log-probs over its completion
(``action_mask``) and hands the pairs to :func:`hyperrl.transforms.preference_loss` with the step's pair count
as the normaliser, so micro-batches and ranks add up to the mean over the step's pairs); and
:class:`PairEvaluator` scores held-out pairs. Each step still publishes version V+1 to the engine
(all-or-nothing), so held-out generation and export see the trained weights. Evaluation scores
``data.val_files``' pairs:
``eval_loss``, ``eval_reward_accuracy`` (TRL's ``eval_rewards/accuracies``; also ``eval_reward_mean``,
what the plot and summary read), ``eval_reward_margin``, ``eval_pair_accuracy`` (the policy alone
prefers the chosen completion). Training metrics are TRL's: ``loss_dpo``, ``rewards_chosen`` /
``rewards_rejected``, ``reward_margin``, ``reward_accuracy`` (also ``reward_mean``), ``logps_*``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.algorithms import LossContext, PolicyOut, eval_mode, sum_terms
from hyperrl.loop.collect import Collected, Timer

__all__ = ["PairCollector", "PairEvaluator", "pairs_batch"]


def pairs_batch(encoded, group_ids, pad_id: int) -> TensorDict:
    """Encoded pairs (:class:`~hyperrl.data.preference.EncodedPair`) → rows ``[2P, T]``: pair ``i`` is rows
    ``2i`` (chosen) and ``2i + 1`` (rejected), each ``prompt + completion``, right-padded; ``action_mask``
    on the completion; ``group_id`` the pair's id; ``chosen`` ``[2P]`` bool."""
    rows = [(e.prompt, comp) for e in encoded for comp in (e.chosen, e.rejected)]
    width = max(len(p) + len(c) for p, c in rows)
    B = len(rows)
    tokens = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros(B, width, dtype=torch.bool)
    act = torch.zeros(B, width, dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        tokens[i, :n] = torch.tensor(list(p) + list(c))
        attn[i, :n] = True
        act[i, len(p):n] = True
    gid = torch.tensor([g for g in group_ids for _ in range(2)], dtype=torch.long)
    chosen = torch.tensor([True, False] * len(encoded))
    return TensorDict({"tokens": tokens, "attention_mask": attn, "action_mask": act, "group_id": gid,
                       "chosen": chosen}, batch_size=[B])


class PairCollector:
    """This rank's share of ``rollout.prompts_per_step`` pairs each step (the task's resumable cursor
    advances the same on every rank), as :func:`pairs_batch` rows; a pair whose two rows exceed the
    micro-batch budget together is refused (the loss needs both in one micro-batch). Nothing runs between
    steps: nothing to pause, no state."""

    def __init__(self, task, parallel, rollout, micro_batch_tokens: int, pad_id: int):
        self.task, self.parallel, self.rollout = task, parallel, rollout
        self.budget, self.pad_id = micro_batch_tokens, pad_id

    def batch(self, pairs: list, ids=None) -> TensorDict:
        """``pairs`` as rows (group ids ``ids``, default ``0, 1, …``)."""
        enc = [self.task.encode_pair(p) for p in pairs]
        if self.budget:
            for p, e in zip(pairs, enc):
                need = 2 * (len(e.prompt) + max(len(e.chosen), len(e.rejected)))
                if need > self.budget:
                    raise ValueError(f"{p.source}: the pair's two rows pad to {need} tokens > "
                                     f"optim.micro_batch_tokens={self.budget}, and a pair's loss needs both in one "
                                     f"micro-batch; raise optim.micro_batch_tokens to ≥ {need} (or 0)")
        return pairs_batch(enc, range(len(pairs)) if ids is None else ids, self.pad_id)

    def collect(self, step: int, version: int, timer: Timer) -> Collected:
        """Step ``step``'s pairs (this rank's share) as rows; ``pairs``: how many."""
        with timer("data"):
            ids = self.parallel.shard(list(range(self.rollout.prompts_per_step)))
            drawn = self.task.sample(self.rollout.prompts_per_step, step)
            mine = [drawn[i] for i in ids]
            return Collected(self.batch(mine, ids), {"pairs": len(mine)}, dict(zip(ids, mine)))

    @contextmanager
    def paused(self, what: str, *, drain: bool = True):
        """Nothing runs between steps: nothing to pause."""
        yield

    def state(self) -> dict:
        """A preference run's collector keeps nothing between steps (the task's cursor travels on its own)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Refuse an asynchronous RL run's checkpoint (its buffer has no meaning here)."""
        if "async" in state:
            raise ValueError("resume: the checkpoint was written by an asynchronous RL run; a preference run cannot "
                             "continue it — choose another run.out_dir")

    def close(self) -> None:
        """Nothing to release."""


class PairEvaluator:
    """The held-out pairs' loss and accuracies (see the module doc): each data-parallel rank scores its share of
    the pairs and the means are combined weighted by the shares' sizes — the means over every pair, the same on
    every rank (with fewer pairs than data-parallel ranks every rank scores all of them). ``preparer`` provides the
    reference's log-probs and ``pipeline`` the loss terms (the preference loss) the held-out pairs are scored by."""

    def __init__(self, collector: PairCollector, preparer, task, parallel, pipeline, *, eval_prompts: int):
        self.collector, self.preparer, self.task, self.parallel = collector, preparer, task, parallel
        self.pipeline, self.eval_prompts = pipeline, eval_prompts

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """The held-out metrics at ``step``: ``eval_loss`` (the terms' sum), every metric of the loss terms prefixed
        ``eval_`` (``eval_reward_mean``: the reward accuracy), ``eval_pairs``."""
        all_pairs = self.task.held_out(self.eval_prompts)
        par = self.parallel
        shard = len(all_pairs) >= par.data_world > 1
        pairs = par.shard(all_pairs) if shard else all_pairs
        f, policy = self.preparer.forwards, self.preparer.policy
        batch = self.preparer.prepare(self.collector.batch(pairs).to(f.device), step=step)[0]
        with eval_mode(policy):
            out = PolicyOut(*f.no_grad(lambda rows: f.logprobs(policy, rows), batch))
        ctx = LossContext(forwards=f, policy=policy, pipeline=self.pipeline)
        # the pairs' count as the normaliser (two rows a pair): each metric the mean over the pairs
        norm = T.Normalizer(batch["action_mask"].sum().float(), torch.tensor(float(batch.batch_size[0])))
        res = sum_terms(t(ctx, batch, out, norm) for t in self.pipeline.terms)
        metrics = {"loss": float(res.loss), **{k: float(v) for k, v in res.metrics.items()}}
        if shard:  # every metric is a mean over the rank's pairs: Σ mean·n / Σ n is the mean over all of them
            sums = par.sum_metrics({**{k: v * len(pairs) for k, v in metrics.items()}, "pairs": float(len(pairs))})
            metrics = {k: sums[k] / sums["pairs"] for k in metrics}
        return {"step": step, **{f"eval_{k}": v for k, v in metrics.items()}, "eval_pairs": len(all_pairs)}
