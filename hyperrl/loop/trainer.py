"""The trainer: the run's state and its step — collect → prepare → transform → update → publish.

:class:`Trainer` holds what changes during a run (step, policy version, counters, the KL
controller's state) and calls its collaborators, all built by the composition root
(:func:`hyperrl.compose.build`) and handed in:

* the **collector** (:mod:`hyperrl.loop.collect`): the step's rewarded, shaped batch — generated
  now (:class:`~hyperrl.loop.collect.SyncCollector`) or taken from rollout workers running ahead
  within the staleness bound (:class:`~hyperrl.loop.collect_async.AsyncCollector`);
* the **pipeline** (:class:`~hyperrl.loop.pipeline.Pipeline`): advantages and the loss pieces;
* the **learner** (:class:`~hyperrl.loop.learner.Learner`): optimizers, lr schedule, one composed loss;
* the **data-parallel strategy** (:mod:`hyperrl.distributed.data_parallel`): every collective;
* the **publisher** (:class:`~hyperrl.loop.publish.PolicyPublisher`), the **evaluator**
  (:class:`~hyperrl.loop.evaluate.Evaluator`) and the **checkpointer**
  (:class:`~hyperrl.loop.checkpointer.Checkpointer`).

:class:`SyncTrainer` and :class:`AsyncTrainer` are the trainer with a synchronous or an
asynchronous collector — composition: everything but collection is the same code. The trainer
imports no ``torch.distributed``. Users observe through hooks ``hook(event, trainer, metrics)``
(:mod:`hyperrl.loop.hooks`); events ``"step"``, ``"eval"``, ``"checkpoint"``, ``"completions"``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.data import data_source
from hyperrl.loop.collect import Timer
from hyperrl.loop.hooks import completion_rows
from hyperrl.loop.prepare import GateError
from hyperrl.models.lora import TrainableView, is_lora
from hyperrl.models.moe import RouterTap, is_moe
from hyperrl.rewards import RewardError

__all__ = ["Trainer", "SyncTrainer", "AsyncTrainer", "GateError"]


class Trainer:
    """One RL run's state and step (see the module doc). Every collaborator arrives built; the
    trainer reads the config's scalars (``cfg``: a resolved :class:`~hyperrl.config.TrainConfig`)."""

    def __init__(self, cfg, *, policy, engine, tokenizer, task, pipeline, collector, generator, scorer, evaluator,
                 forwards, preparer, learner, publisher, checkpointer, kl_controller, parallel, reference=None,
                 critic=None, hooks=()):
        self.cfg, self.policy, self.engine, self.tok, self.task = cfg, policy, engine, tokenizer, task
        self.pipeline, self.collector, self.generator, self.scorer = pipeline, collector, generator, scorer
        self.evaluator, self.learner, self.publisher, self.checkpointer = evaluator, learner, publisher, checkpointer
        self.forwards, self.preparer = forwards, preparer
        self.parallel, self.reference, self.critic = parallel, reference, critic
        self.hooks = list(hooks)
        self.device = next(policy.parameters()).device
        self.lora = is_lora(policy)  # adapters train; publication merges them; checkpoints hold them only
        self.kl_controller = kl_controller  # an (init, update) pair
        self.kl_state = kl_controller.init()
        self.step_idx, self.version = 0, engine.policy_version
        self.samples_seen = self.tokens_seen = 0

    # ------------------------------------------------------------------ the step, top to bottom
    def step(self) -> dict:
        """One RL step; returns its metrics (averaged over data-parallel ranks)."""
        timer = Timer()
        try:
            batch, info = self.collect(timer)  # rollout → rewards → shaping → filter (refilled)
        except RewardError as e:
            raise RewardError(f"step {self.step_idx + 1}: {e}", row=e.row) from e
        batch = self.parallel.share_batch(batch.to(self.device))  # a context-parallel group trains one batch
        gate, losses = {}, {"update_skipped": 1.0}
        if self.parallel.all_have_rows(batch.batch_size[0]):  # else every rank skips alike
            with timer("logprob"):
                batch, gate = self.prepare(batch)  # critic values, old / reference log-probs, gate
            batch = self.pipeline.transform(batch)  # advantages (and returns)
            with timer("update"):
                losses = self.update(batch)
            with timer("publish"):
                self.publish()
            losses = {**losses, **self.publisher.stats()}  # delta publication: delta_frac, bytes
        if self.cfg.run.log_completions and self.parallel.rank == 0:
            rows = completion_rows(batch, self.tok, self.scorer.names, self.cfg.run.log_completions)
            self._emit("completions", {"step": self.step_idx + 1, "rows": rows})
        self.step_idx += 1
        return self._report(batch, timer, {**info, **gate, **losses})

    def collect(self, timer: Timer) -> tuple[TensorDict, dict]:
        """The step's batch and its metrics, from the collector (override to observe every batch)."""
        return self.collector.collect(self, timer)

    @property
    def reward_names(self) -> tuple[str, ...]:
        """The columns of ``reward_components`` (``env`` first in multi-turn runs)."""
        return self.scorer.names

    # ------------------------------------------------------------------ prepare
    def prepare(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        """Critic values, the greedy baseline, old / reference log-probs and the gate
        (:class:`~hyperrl.loop.prepare.Preparer`)."""
        return self.preparer.prepare(batch, step=self.step_idx, version=self.version, baseline=self.greedy_baseline,
                                     sources=self.data_sources)

    def data_sources(self, batch: TensorDict) -> list:
        """Each row's ``data_source`` (its prompt's ``extra``; None when the task has none) ``[B]``."""
        return [data_source(self.collector.samples[g]) for g in batch["group_id"].tolist()]

    def greedy_baseline(self, batch: TensorDict) -> torch.Tensor:
        """ReMax's baseline: the reward of one near-greedy rollout (temperature 1e-5) per group,
        broadcast to the group's rows ``[B]``."""
        groups = torch.unique(batch["group_id"]).tolist()
        samples = [self.collector.samples[g] for g in groups]
        gen = self.generator
        greedy = self.scorer.score(gen.generate(samples, gen.sampling(self.step_idx, 10**8, temperature=1e-5), 1),
                                   dict(enumerate(samples)))["reward"]
        by_group = dict(zip(groups, greedy.tolist()))
        return torch.tensor([by_group[g] for g in batch["group_id"].tolist()], dtype=torch.float32)

    # ------------------------------------------------------------------ update, publish
    def loss(self, part: TensorDict, norm: T.Normalizer) -> T.LossOutput:
        """The composed loss of a micro-batch: the policy terms (objective, KL, entropy, correction)
        plus the critic's value term; mismatch metrics from ``transforms.correction``."""
        p = self.pipeline
        if is_moe(self.policy):  # the router's load-balancing term and metrics, from the update's own forward
            routes = self.preparer.update_routes(part)  # routing replay (R2 / R3) or the agreement measured
            self.preparer.routing.reset()
            with RouterTap(self.policy) as tap:
                lp, ent, _ = self.forwards.logprobs(self.policy, part, routes)
            # each forward's share of the step's action tokens (all ranks, micro-batches): the term sums to the
            # coefficient once per optimizer step — one process over the full batch: exactly the family's loss
            share = float(part["action_mask"].sum()) / max(float(norm.num_tokens), 1.0)
            router = T.router_loss(tap.logits, tap.top_k, self.cfg.model.router_aux_loss_coef * share, tap.mask)
            if self.preparer.single_pass:  # else the old pass measured the agreement at the rollout's weights
                agree = self.preparer.routing.metrics()
                router = router + T.LossOutput({}, {k: torch.tensor(v) for k, v in agree.items()})
        else:
            lp, ent = self.forwards.logprobs(self.policy, part)
            router = None
        if self.cfg.algo.proximal == "interpolate":  # A-3PO: π_prox from the token versions, no proximal forward
            part = part.copy().set("old_logprobs", T.interpolated_proximal_logprobs(
                part["rollout_logprobs"], lp, part["token_version"], part["action_mask"], self.version))
        # a correction may read the current policy's (detached) log-probs: OPSM's mean log-ratio
        corr = p.correction(part.copy().set("logprobs", lp.detach())) if p.correction is not None else None
        out = T.policy_loss(part, lp, normalizer=norm, entropy=ent, correction=corr,
                            **p.loss_kwargs(self.kl_state.beta))
        if self.preparer.single_pass:
            out = out + T.LossOutput({}, T.mismatch_metrics(lp, part["rollout_logprobs"], part["action_mask"]))
        d = self.cfg.algo.distill
        if d is not None and d.full_vocab:  # on-policy GKD: the whole next-token distribution toward the teacher's
            out = out + self._full_vocab_distill(part, norm, d.coef, d.jsd_beta)
        if self.critic is not None:
            c = self.cfg.algo.critic
            values = self.forwards.values(self.critic, part)
            out = out + T.critic_loss(part, values, clip=c.value_clip, agg=p.agg, normalizer=norm, coef=c.value_coef)
        return out if router is None else out + router

    def _full_vocab_distill(self, part: TensorDict, norm: T.Normalizer, coef: float, beta: float) -> T.LossOutput:
        """``loss_distill = coef · agg(JSD_β(π_s(·|s_t), π_t(·|s_t)))`` over the action tokens (β = 1: the reverse
        KL), the teacher's distribution from a no-grad forward of the same micro-batch."""
        a, s = self.forwards.log_softmax(self.policy, part)
        with torch.no_grad():
            _, t = self.forwards.log_softmax(self.preparer.teachers[None], part)
        kl = T.full_vocab_jsd(s, t, beta)  # [b, T − a]
        m = part["action_mask"][:, a:]
        loss = coef * T.aggregate(kl, m, self.pipeline.agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs,
                                  length_const=norm.length_const)
        return T.LossOutput({"loss_distill": loss}, {"distill_kl": kl.detach()[m].mean() if bool(m.any())
                                                     else torch.zeros(())})

    def update(self, batch: TensorDict) -> dict:
        """The learner's pass over ``batch``; then the KL controller's update from the measured KL."""
        o = self.cfg.optim
        m = self.learner.update(batch, self.loss, epochs=self.cfg.algo.ppo_epochs, mini_batches=o.mini_batches,
                                seed=self.cfg.run.seed + self.step_idx, micro_batch_tokens=o.micro_batch_tokens,
                                length_const=self.cfg.rollout.max_new_tokens)
        if "kl" in m:
            self.kl_state = self.kl_controller.update(self.kl_state, m["kl"], batch.batch_size[0])
            m["kl_coef"] = self.kl_state.beta
        return m

    def publish(self) -> None:
        """Publish the policy as version V+1 (all-or-nothing) while the collector is paused: a
        refused publication raises ``WeightPublishError``; the engine still serves V and the run
        fails closed."""
        with self.collector.paused(f"pausing for the publication of version {self.version + 1}"):
            self.publisher.publish(self.version + 1)
            self.version += 1

    # ------------------------------------------------------------------ report, evaluate
    def _report(self, batch: TensorDict, timer: Timer, extra: dict) -> dict:
        self.samples_seen += batch.batch_size[0]
        tokens = int(batch["attention_mask"].sum())
        self.tokens_seen += tokens
        metrics = {"step": self.step_idx, "policy_version": self.version, **self._batch_metrics(batch), **extra,
                   **timer.t}
        metrics["tokens_per_s"] = tokens / max(sum(timer.t.values()), 1e-9)
        metrics = self.parallel.mean_metrics(metrics)
        self._emit("step", metrics)
        return metrics

    def _batch_metrics(self, batch: TensorDict) -> dict:
        if batch.batch_size[0] == 0:
            return {"reward_mean": float("nan")}
        r, m = batch["reward"], batch["action_mask"]
        g = T.group_stats(r, batch["group_id"])
        adv = batch["advantages"][m] if "advantages" in batch.keys() else torch.zeros(1)
        out = {"reward_mean": float(r.mean()), "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
               "zero_variance_group_frac": float(g.constant.float().mean()), "adv_mean": float(adv.mean()),
               "adv_std": float(adv.std()) if adv.numel() > 1 else 0.0, "adv_max_abs": float(adv.abs().max()),
               "response_len_mean": float(m.sum(-1).float().mean()),
               "response_clipped_frac": float(self.scorer.clipped(batch).float().mean())}
        if self.pipeline.shaped and "reward_components" in batch.keys():  # the score before shaping
            out["reward_raw_mean"] = float(self.scorer.raw_reward(batch).mean())
        if "tool_calls" in batch.keys():  # multi-turn: how often the policy used a tool
            calls = batch["tool_calls"].float()
            out["tool_call_rate"], out["tool_calls_mean"] = float((calls > 0).float().mean()), float(calls.mean())
        if "success" in batch.keys():  # the environment's verdict, whatever reward shaping adds
            out["success_rate"] = float(batch["success"].float().mean())
        comps = batch["reward_components"] if "reward_components" in batch.keys() else None
        if comps is not None:  # each reward over the rows it applies to (one reward too)
            app = batch["reward_applicable"]
            for k, name in enumerate(self.scorer.names):
                if bool(app[:, k].any()):
                    out[f"reward_{name}_mean"] = float(comps[:, k][app[:, k]].mean())
                out[f"reward_{name}_applicable_frac"] = float(app[:, k].float().mean())
        out.update(self.scorer.pop_extra())
        return out

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out evaluation (:class:`~hyperrl.loop.evaluate.Evaluator`) while the collector is
        paused (an asynchronous run's engine is the workers')."""
        with self.collector.paused("pausing for evaluation", drain=False):
            try:
                metrics = self.evaluator.evaluate(self.step_idx)
            except RewardError as e:
                raise RewardError(f"evaluation at step {self.step_idx}: {e}", row=e.row) from e
        self._emit("eval", metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoint / resume
    def _parts(self) -> dict[str, tuple]:
        """Checkpoint part name → (module, its optimizer part name, optimizer)."""
        policy = TrainableView(self.policy) if self.lora else self.policy
        mods = {"model": (policy, "optim", self.learner.modules["policy"].optimizer)}
        if self.critic is not None:
            mods["critic"] = (self.critic, "critic_optim", self.learner.modules["critic"].optimizer)
        return mods

    def save(self, *, _crash_after: str | None = None) -> Path:
        """Atomic checkpoint: each rank writes its own shards (no gather), rank 0 the marker; the
        collector's state (an asynchronous run's buffer) travels in it."""
        state = {"step": self.step_idx, "version": self.version, "samples_seen": self.samples_seen,
                 "tokens_seen": self.tokens_seen, "optim_steps": self.learner.optim_steps,
                 "kl_coef": self.kl_state.beta, "task": self.task.state(), "config": self.cfg.to_dict(),
                 **self.collector.state()}
        path = self.checkpointer.save(self.step_idx, self._parts(), state, _crash_after=_crash_after)
        if self.parallel.rank == 0:
            self._emit("checkpoint", {"step": self.step_idx, "path": str(path)})
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the given checkpoint, or the newest one that verifies (every file against its
        checksum; each one skipped is said, naming the file) — this rank's shards into its local
        parameters and optimizer state — and refit the engine before generating. A checkpoint of
        another model (:func:`hyperrl.config.compare.loadability_changes`) is refused before
        anything is loaded; changed hyperparameters are kept in ``self.resume_report``."""
        import json

        from hyperrl.config.compare import config_changes, loadability_changes
        from hyperrl.loop.checkpoint import CheckpointError

        self.resume_report = {"skipped": [], "changes": {}}
        verified = path is None
        if path is None:
            path, skipped = self.checkpointer.newest_intact()
            self.resume_report["skipped"] = skipped
            if path is None and not skipped:
                return False
            if path is None:
                raise CheckpointError(f"{self.checkpointer.root}: no checkpoint verifies ({len(skipped)} damaged: "
                                      + "; ".join(why for _, why in skipped) + ") — start fresh with --no-resume "
                                      "(they are set aside) or choose another run.out_dir")
        path = Path(path)
        old = json.loads((path / "state.json").read_text()).get("config")
        if old is not None:
            now = self.cfg.to_dict()
            other = loadability_changes(old, now)
            if other:
                said = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in other.items())
                raise CheckpointError(f"{path.parent.parent} holds another model's run ({said}) — resuming would mix "
                                      "the runs; set run.out_dir to a new directory, or --no-resume to start fresh "
                                      "here (its checkpoints are set aside)")
            self.resume_report["changes"] = config_changes(old, now)
        self.resume_report["path"] = str(path)
        st = self.checkpointer.load(path, self._parts(), verified=verified)
        self.collector.load_state(st)
        self.step_idx, self.samples_seen, self.tokens_seen = st["step"], st["samples_seen"], st["tokens_seen"]
        self.learner.optim_steps = st.get("optim_steps", 0)
        if "kl_coef" in st:
            self.kl_state = type(self.kl_state)(st["kl_coef"])
        self.task.load_state(st.get("task", {}))
        # versions only grow: an engine already past the checkpoint's version gets the next one
        target = st["version"] if self.engine.policy_version < st["version"] else self.engine.policy_version + 1
        self.publisher.publish(target)  # refit before the first generation
        self.version = target
        return True

    def close(self) -> None:
        """Release the collector's workers (an asynchronous run's threads, Ray actors) and an agent's gateway."""
        try:
            self.collector.close()
        finally:
            self.generator.close()

    def _emit(self, event: str, metrics: dict) -> None:
        for h in self.hooks:
            h(event, self, metrics)


class SyncTrainer(Trainer):
    """The trainer with a :class:`~hyperrl.loop.collect.SyncCollector`: each step generates its
    batch from the current version (on-policy)."""


class AsyncTrainer(Trainer):
    """The trainer with an :class:`~hyperrl.loop.collect_async.AsyncCollector`: rollout workers
    generate ahead while the learner trains, every trained token at most ``async.max_staleness``
    versions stale; η = 0 equals :class:`SyncTrainer` bit for bit (docs/async.md)."""

    @property
    def buffer(self):
        """The admission buffer (:class:`hyperrl.loop.admission.Buffer`) at this moment."""
        return self.collector.buffer

    @property
    def eta(self) -> int:
        """The staleness bound η."""
        return self.collector.eta
