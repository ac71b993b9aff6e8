"""Preference training (DPO and kin, ``algo.preference``): the trainer's step over pairs instead of rollouts.

The same house as RL — policy, reference, learner, data-parallel strategy, publisher, checkpointer —
with two pieces swapped: :class:`PairCollector` reads this rank's share of ``rollout.prompts_per_step``
pairs from the ``preference`` task (:mod:`hyperrl.data.preference`) and lays each out as two rows,
chosen then rejected, sharing a ``group_id`` (the pair) and the same prompt ids; :class:`PreferenceTrainer`
computes the reference's log-probs once per batch, and its loss sums each row's log-probs over its
completion (``action_mask``) and hands the pairs to :func:`hyperrl.transforms.preference_loss` with
the step's pair count as the normaliser (so micro-batches and ranks add up to the mean over the
step's pairs). Each step still publishes version V+1 to the engine (all-or-nothing), so held-out
generation and export see the trained weights. Evaluation scores ``data.val_files``' pairs:
``eval_loss``, ``eval_reward_accuracy`` (TRL's ``eval_rewards/accuracies``; also ``eval_reward_mean``,
what the plot and summary read), ``eval_reward_margin``, ``eval_pair_accuracy`` (the policy alone
prefers the chosen completion). Training metrics are TRL's: ``loss_dpo``, ``rewards_chosen`` /
``rewards_rejected``, ``reward_margin``, ``reward_accuracy`` (also ``reward_mean``), ``logps_*``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.loop.collect import SyncCollector, Timer
from hyperrl.loop.prepare import _eval_mode
from hyperrl.loop.trainer import SyncTrainer

__all__ = ["PairCollector", "PreferenceTrainer", "pairs_batch"]


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


class PairCollector(SyncCollector):
    """This rank's share of ``rollout.prompts_per_step`` pairs each step (the task's resumable cursor
    advances the same on every rank), as :func:`pairs_batch` rows; a pair whose two rows exceed the
    micro-batch budget together is refused (the loss needs both in one micro-batch). Pausing, state and closing
    are the synchronous collector's (nothing runs between steps)."""

    def __init__(self, task, parallel, rollout, micro_batch_tokens: int, pad_id: int):
        self.task, self.parallel, self.rollout = task, parallel, rollout
        self.budget, self.pad_id = micro_batch_tokens, pad_id
        self.samples: dict = {}

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

    def collect(self, trainer, timer: Timer) -> tuple[TensorDict, dict]:
        with timer("data"):
            ids = self.parallel.shard(list(range(self.rollout.prompts_per_step)))
            drawn = self.task.sample(self.rollout.prompts_per_step, trainer.step_idx)
            mine = [drawn[i] for i in ids]
            self.samples = dict(zip(ids, mine))
            return self.batch(mine, ids), {}

    def load_state(self, state: dict) -> None:
        if "async" in state:
            raise ValueError("resume: the checkpoint was written by an asynchronous RL run; a preference run cannot "
                             "continue it — choose another run.out_dir")


class PreferenceTrainer(SyncTrainer):
    """The trainer over preference pairs (see the module doc); built by :func:`hyperrl.compose.build`
    when ``algo.preference`` is set."""

    def __init__(self, cfg, **parts):
        super().__init__(cfg, **parts)
        spec = cfg.algo.preference
        self.preference = T.PREFERENCE_LOSSES.build(spec.name, **spec.args)
        self.beta = float(spec.args["beta"])

    def step(self) -> dict:
        """One optimizer step over this step's pairs; then publish version V+1."""
        timer = Timer()
        batch, info = self.collect(timer)
        batch = batch.to(self.device)
        with timer("logprob"):
            batch = self.prepare(batch)[0]
        with timer("update"):
            losses = self.update(batch)
        with timer("publish"):
            self.publish()
        self.step_idx += 1
        return self._report(batch, timer, {**info, **losses})

    def prepare(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        """The reference's log-probs of every row ``[B, T]``, once per batch (micro-batched, no grad)."""
        f = self.forwards
        with torch.no_grad(), _eval_mode(self.policy):  # no dropout (LoRA's) in the reference
            ref = f.no_grad(lambda rows: f.logprobs(self.reference, rows), batch)[0]
        return batch.copy().set("ref_logprobs", ref), {}

    def _pairs(self, lp: torch.Tensor, part: TensorDict):
        """Per-pair ``(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len)`` ``[P]`` of a
        micro-batch: each row's log-probs summed over its completion, chosen rows matched to rejected by pair."""
        m = part["action_mask"]
        seq, ref, n = (lp * m).sum(-1), (part["ref_logprobs"] * m).sum(-1), m.sum(-1)
        gid, chosen = part["group_id"], part["chosen"]
        ic = torch.nonzero(chosen).flatten()
        ir = torch.nonzero(~chosen).flatten()
        ic, ir = ic[torch.argsort(gid[ic])], ir[torch.argsort(gid[ir])]
        if ic.numel() != ir.numel() or not torch.equal(gid[ic], gid[ir]):
            raise ValueError(f"preference loss: the micro-batch's rows do not form whole pairs (pairs "
                             f"{sorted(set(gid.tolist()))}); a pair's chosen and rejected rows must train together")
        return seq[ic], seq[ir], ref[ic], ref[ir], n[ic], n[ir]

    def loss(self, part: TensorDict, norm: T.Normalizer) -> T.LossOutput:
        """The preference loss of a micro-batch's pairs, normalised by the step's pair count (half its
        sequences: every completion has tokens); a one-row part is a rank's zero-weight lockstep pass."""
        lp, _ = self.forwards.logprobs(self.policy, part)
        if part.batch_size[0] == 1:
            return T.LossOutput({"loss_dpo": lp.sum() * 0.0})
        return T.preference_loss(self.preference, *self._pairs(lp, part), beta=self.beta,
                                 num_pairs=torch.as_tensor(norm.num_seqs) / 2)

    def update(self, batch: TensorDict) -> dict:
        """One optimizer step over the batch's pairs (micro-batched by ``optim.micro_batch_tokens``)."""
        return self.learner.update(batch, self.loss, epochs=1, mini_batches=1, seed=self.cfg.run.seed + self.step_idx,
                                   micro_batch_tokens=self.cfg.optim.micro_batch_tokens)

    def _batch_metrics(self, batch: TensorDict) -> dict:
        m = batch["action_mask"]
        return {"pairs": batch.batch_size[0] // 2, "response_len_mean": float(m.sum(-1).float().mean())}

    def _report(self, batch, timer, extra: dict) -> dict:
        if "reward_accuracy" in extra:  # what the progress bar and the plot read
            extra = {**extra, "reward_mean": extra["reward_accuracy"]}
        return super()._report(batch, timer, extra)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The held-out pairs' loss and accuracies (see the module doc): each data-parallel rank scores its share of
        the pairs and the means are combined weighted by the shares' sizes — the means over every pair, the same on
        every rank (with fewer pairs than data-parallel ranks every rank scores all of them)."""
        all_pairs = self.task.held_out(self.cfg.run.eval_prompts)
        par = self.forwards.parallel
        shard = len(all_pairs) >= par.data_world > 1
        pairs = par.shard(all_pairs) if shard else all_pairs
        batch = self.collector.batch(pairs).to(self.device)
        batch = self.prepare(batch)[0]
        f = self.forwards
        with _eval_mode(self.policy):
            lp = f.no_grad(lambda rows: f.logprobs(self.policy, rows), batch)[0]
        out = T.preference_loss(self.preference, *self._pairs(lp, batch), beta=self.beta).scalars()
        if shard:  # every metric is a mean over the rank's pairs: Σ mean·n / Σ n is the mean over all of them
            sums = par.sum_metrics({**{k: v * len(pairs) for k, v in out.items()}, "pairs": float(len(pairs))})
            out = {k: sums[k] / sums["pairs"] for k in out}
        metrics = {"step": self.step_idx, "eval_loss": out["loss_dpo"], "eval_reward_mean": out["reward_accuracy"],
                   **{f"eval_{k}": v for k, v in out.items() if k != "loss_dpo"}, "eval_pairs": len(all_pairs)}
        self._emit("eval", metrics)
        return metrics
