"""The trainer: the run's state and its step — collect → prepare → transform → update → publish.

:class:`Trainer` holds what changes during a run (step, policy version, counters, the KL
controller's state) and calls its collaborators, all built by the composition root
(:func:`hyperrl.compose.build`) and handed in:

* the **collector** (:mod:`hyperrl.loop.collect`): the step's batch as a
  :class:`~hyperrl.loop.collect.Collected` record — generated now
  (:class:`~hyperrl.loop.collect.SyncCollector`), taken from rollout workers running ahead within the
  staleness bound (:class:`~hyperrl.loop.collect_async.AsyncCollector`), or preference pairs read from files
  (:class:`~hyperrl.loop.preference.PairCollector`);
* the **preparer** (:class:`~hyperrl.loop.prepare.Preparer`): the registered key providers of what the
  pipeline needs (:mod:`hyperrl.algorithms.keys`) and the update's policy forward;
* the **pipeline** (:class:`~hyperrl.loop.pipeline.Pipeline`): advantages and the loss terms
  (:mod:`hyperrl.algorithms.terms`) whose sum is :meth:`Trainer.loss`;
* the **learner** (:class:`~hyperrl.loop.learner.Learner`): optimizers, lr schedule, one composed loss;
* the **data-parallel strategy** (:mod:`hyperrl.distributed.strategy`): every collective;
* the **publisher** (:class:`~hyperrl.loop.publish.PolicyPublisher`), the **evaluator**
  (:class:`~hyperrl.loop.evaluate.Evaluator`, or :class:`~hyperrl.loop.preference.PairEvaluator`) and the
  **checkpointer** (:class:`~hyperrl.loop.checkpointer.Checkpointer`).

One class for every kind of run: synchronous, asynchronous and preference runs differ only by the
collector and evaluator handed in (``SyncTrainer``, ``AsyncTrainer`` and ``PreferenceTrainer`` are
its names in earlier releases). The trainer imports no ``torch.distributed``. Users observe through
hooks ``hook(event, trainer, metrics)`` (:mod:`hyperrl.loop.hooks`); events ``"step"``, ``"eval"``,
``"checkpoint"``, ``"completions"``, ``"batch"`` (``{"step", "batch", "metrics", "spans", "events"}``: the trained
batch after the pipeline — what :mod:`hyperrl.loop.fingerprints` records — and the step's timed stages and collector
events, what :mod:`hyperrl.loop.timeline` records) and ``"span"`` (an evaluation's or a checkpoint's time).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.algorithms import GateError, LossContext, sum_terms
from hyperrl.loop.collect import Collected, SyncCollector, Timer
from hyperrl.loop.hooks import completion_rows
from hyperrl.models.lora import TrainableView, is_lora
from hyperrl.rewards import RewardError

__all__ = ["Trainer", "SyncTrainer", "AsyncTrainer", "PreferenceTrainer", "GateError"]


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
        self._doctor_due = self._doctor_done = False

    # ------------------------------------------------------------------ the step, top to bottom
    def step(self) -> dict:
        """One RL step; returns its metrics (averaged over data-parallel ranks)."""
        timer = Timer()
        try:
            got = self.collect(timer)  # rollout → rewards → shaping → filter (refilled)
        except RewardError as e:
            raise RewardError(f"step {self.step_idx + 1}: {e}", row=e.row) from e
        batch = self.parallel.share_batch(got.batch.to(self.device))  # a context-parallel group trains one batch
        gate, losses = {}, {"update_skipped": 1.0}
        if self.parallel.all_have_rows(batch.batch_size[0]):  # else every rank skips alike
            with timer("logprob"):
                try:
                    batch, gate = self.prepare(batch, samples=got.samples)  # the keys the pipeline needs, the gate
                except GateError as e:  # why the gate is refused: the doctor's verdict on this batch
                    raise GateError(f"{e}; doctor: {self.doctor(batch).verdict()}") from e
            if self._doctor_due:  # the mismatch was high last step: diagnose this batch before its update
                self._doctor_due = False
                self._doctor_done = True
                d = self.doctor(batch)
                verdict = d.verdict()
                print(f"warning: step {self.step_idx + 1}: trainer vs engine log-probs — {verdict} "
                      "(hyperrl.loop.doctor; run.doctor_above)", file=sys.stderr, flush=True)
                self._emit("doctor", {"step": self.step_idx + 1, "gap": d.gap, "verdict": verdict,
                                      "causes": {c[0]: c[3] for c in d.causes},
                                      **({"layers": {d.layers[0]: d.layers[1]}} if d.layers else {})})
            batch = self.pipeline.transform(batch)  # advantages (and returns)
            if self.engine.capabilities.sleeps:  # the engine frees its memory for the update; publish wakes it
                self.engine.sleep()
            with timer("update"):
                losses = self.update(batch)
            with timer("publish"):
                self.publish()
            losses = {**losses, **self.publisher.stats()}  # delta publication: delta_frac, bytes
        if self.cfg.run.log_completions and self.parallel.rank == 0 and "reward" in batch.keys():
            rows = completion_rows(batch, self.tok, self.scorer.names, self.cfg.run.log_completions)
            self._emit("completions", {"step": self.step_idx + 1, "rows": rows})
        self.step_idx += 1
        metrics = self._report(batch, timer, {**got.metrics, **gate, **losses})
        above = self.cfg.run.doctor_above
        if above is not None and not self._doctor_done and metrics.get("mismatch_mean_abs", 0.0) > above:
            self._doctor_due = True  # at most once a run: the causes are systematic
        self._emit("batch", {"step": self.step_idx, "batch": batch, "metrics": metrics,  # e.g. its fingerprints
                             "spans": timer.spans, "events": got.events})  # the step's timeline
        return metrics

    @torch.no_grad()
    def doctor(self, batch: TensorDict):
        """The mismatch doctor on ``batch`` with the trainer's policy as it is now
        (:func:`hyperrl.loop.doctor.diagnose`): which known cause makes the engine's log-probs differ."""
        from hyperrl.device import torch_dtype
        from hyperrl.loop.doctor import DoctorContext, diagnose

        r, m = self.cfg.rollout, self.cfg.model
        ctx = DoctorContext(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, dtype=torch_dtype(m.dtype),
                            head_dtype=torch.float32 if m.lm_head_fp32 else None, version=self.version,
                            pad_id=self.tok.pad_token_id)
        return diagnose(self.policy, batch.to(self.device), ctx)

    def cancel_collect(self, reason: str) -> bool:
        """End the synchronous collection under way now — an agent round waits on its agents, up to
        ``env.timeout_s`` — when the run is asked to stop; the step then raises and nothing of it is kept (the
        step is generated again on resume). One process only (a rank ending its step alone would leave the
        others in a collective); → whether it was asked."""
        if self.parallel.world != 1 or not isinstance(self.collector, SyncCollector):
            return False
        self.generator.cancel(reason)
        return True

    def collect(self, timer: Timer) -> Collected:
        """The step's batch, its metrics and prompts, from the collector (override to observe every batch)."""
        return self.collector.collect(self.step_idx, self.version, timer)

    @property
    def reward_names(self) -> tuple[str, ...]:
        """The columns of ``reward_components`` (``env`` first in multi-turn runs)."""
        return self.scorer.names

    # ------------------------------------------------------------------ prepare, loss
    def prepare(self, batch: TensorDict, *, samples: dict | None = None) -> tuple[TensorDict, dict]:
        """The keys the pipeline needs, from their registered providers (:class:`~hyperrl.loop.prepare.Preparer`;
        ``samples``: the step's prompts by group id, :attr:`Collected.samples`), and the gate's metrics."""
        return self.preparer.prepare(batch, step=self.step_idx, version=self.version, samples=samples)

    def loss(self, part: TensorDict, norm: T.Normalizer) -> T.LossOutput:
        """The loss of a micro-batch: the sum of the pipeline's loss terms (:mod:`hyperrl.algorithms.terms`) over
        one policy forward."""
        ctx = LossContext(forwards=self.forwards, policy=self.policy, pipeline=self.pipeline,
                          kl_beta=self.kl_state.beta, version=self.version, single_pass=self.preparer.single_pass,
                          critic=self.critic, teachers=self.preparer.teachers, routes=self.preparer.routes)
        out = self.preparer.policy_forward(part)
        return sum_terms(term(ctx, part, out, norm) for term in self.pipeline.terms)

    def update(self, batch: TensorDict) -> dict:
        """The learner's pass over ``batch`` — its rows first balanced by tokens over the data-parallel ranks
        (``optim.balance_rows``) —; then the KL controller's update from the measured KL."""
        o = self.cfg.optim
        n, balance = batch.batch_size[0], {}
        if o.balance_rows:
            batch, balance = self.parallel.balance_rows(batch, self.tok.pad_token_id or 0, self.policy)
        m = self.learner.update(batch, self.loss, epochs=self.cfg.algo.ppo_epochs, mini_batches=o.mini_batches,
                                seed=self.cfg.run.seed + self.step_idx, micro_batch_tokens=o.micro_batch_tokens,
                                length_const=self.cfg.rollout.max_new_tokens)
        if "kl" in m:
            self.kl_state = self.kl_controller.update(self.kl_state, m["kl"], n)
            m["kl_coef"] = self.kl_state.beta
        return {**m, **balance}

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
        if "reward" not in batch.keys():  # preference pairs: the loss term reports their rewards
            return {"response_len_mean": float(batch["action_mask"].sum(-1).float().mean())}
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
        wall, t0 = time.time(), time.perf_counter()
        with self.collector.paused("pausing for evaluation", drain=False):
            try:
                metrics = self.evaluator.evaluate(self.step_idx)
            except RewardError as e:
                raise RewardError(f"evaluation at step {self.step_idx}: {e}", row=e.row) from e
        self._emit("span", {"step": self.step_idx, "name": "evaluate", "t0": wall, "dur": time.perf_counter() - t0})
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
        wall, t0 = time.time(), time.perf_counter()
        path = self.checkpointer.save(self.step_idx, self._parts(), state, _crash_after=_crash_after)
        self._emit("span", {"step": self.step_idx, "name": "checkpoint", "t0": wall, "dur": time.perf_counter() - t0})
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

        from hyperrl.config.compare import config_changes, loadability_changes, refuse_resume
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
                raise CheckpointError(refuse_resume(path.parent.parent, other))
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
        """Release the collector's workers (an asynchronous run's threads, Ray actors), an agent's gateway and the
        rewards' pools."""
        try:
            self.collector.close()
        finally:
            try:
                self.generator.close()
            finally:
                self.scorer.close()

    def _emit(self, event: str, metrics: dict) -> None:
        for h in self.hooks:
            h(event, self, metrics)


# the names of earlier releases, when the kind of run chose the class (now: the collector and evaluator)
SyncTrainer = AsyncTrainer = PreferenceTrainer = Trainer
