"""The thin SyncTrainer: collect → prepare → transform → update → publish, along four seams.

* the **pipeline** (:class:`hyperrl.recipes.Pipeline`): reward shaping, the group filter,
  advantages and the loss pieces, bound from the config's recipe — replace it in Python;
* the **learner** (:class:`hyperrl.learner.Learner`): optimizers and lr schedule, one composed
  loss function (policy terms + the critic's value term);
* the **data-parallel strategy** (:mod:`hyperrl.parallel`): every collective and lockstep rule;
* the **publisher** (:class:`hyperrl.sharding.publisher.Publisher`) and the **checkpointer**
  (:class:`hyperrl.checkpointer.Checkpointer`).

The trainer holds the run's mutable state (step, version, counters, KL coefficient) and imports
no ``torch.distributed``. Users observe through hooks ``hook(event, trainer, metrics)``; events:
``"step"``, ``"eval"``, ``"checkpoint"``.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tensordict import TensorDict

from . import transforms as T
from .checkpointer import Checkpointer
from .config import TrainConfig
from .forward import policy_logprobs
from .learner import Learner, Optimized, map_micro_batches
from .parallel import LocalParallel, make_parallel
from .recipes import Pipeline, build_pipeline
from .sampling import SamplingParams
from .sharding.publisher import Publisher
from .trajectory import cat_batches

__all__ = ["SyncTrainer", "GateError", "ValueModel", "write_jsonl"]


class GateError(RuntimeError):
    """The bit-exact gate refused an update: trainer and rollout log-probs disagree."""


class ValueModel(torch.nn.Module):
    """A critic: a causal-LM backbone plus a linear value head. ``forward(batch)`` returns
    token-aligned values ``[B, T]``: ``values[:, t]`` is the value of the state before token ``t``
    (read from the hidden state at ``t − 1``, like the log-probs); ``values[:, 0] = 0``."""

    def __init__(self, backbone, hidden: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: TensorDict) -> torch.Tensor:
        h = self.backbone(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).last_hidden_state
        v = self.head(h[:, :-1]).squeeze(-1)
        return torch.nn.functional.pad(v, (1, 0))


class _Timer:
    def __init__(self):
        self.t: dict[str, float] = {}

    @contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.t[f"time_{name}_s"] = self.t.get(f"time_{name}_s", 0.0) + time.perf_counter() - t0


class SyncTrainer:
    def __init__(self, cfg: TrainConfig, *, policy, engine, tokenizer, task, pipeline: Pipeline | None = None,
                 hooks=(), reference=None, critic=None, make_env=None, parallel: LocalParallel | None = None):
        self.cfg, self.policy, self.engine, self.tok, self.task = cfg, policy, engine, tokenizer, task
        self.pipeline = pipeline or build_pipeline(cfg.algo)
        needs = self.pipeline.needs
        if "ref_logprobs" in needs and reference is None:
            raise ValueError("algo.kl.coef > 0 needs a reference model (pass reference=...; hyperrl train builds one)")
        if "values" in needs and critic is None:
            raise ValueError(f"algo.advantage={cfg.algo.advantage.name!r} needs a critic's values (pass "
                             "critic=ValueModel(...); hyperrl train builds one)")
        self.reference, self.critic, self.make_env = reference, critic, make_env
        self.hooks = list(hooks)
        self.parallel = parallel or make_parallel()
        o, a = cfg.optim, cfg.algo
        parts = {"policy": Optimized(policy, torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=o.betas,
                                                               weight_decay=o.weight_decay), o.lr)}
        if critic is not None:
            parts["critic"] = Optimized(critic, torch.optim.AdamW(critic.parameters(), lr=a.critic.lr), a.critic.lr)
        self.learner = Learner(parts, grad_clip=o.grad_clip, schedule=o.schedule, warmup=o.warmup_steps,
                               min_lr_ratio=o.min_lr_ratio, total_steps=cfg.run.steps * o.mini_batches * a.ppo_epochs,
                               parallel=self.parallel)
        self.publisher = Publisher(policy, engine, rank=self.parallel.rank, world=self.parallel.world)
        self.checkpointer = Checkpointer(Path(cfg.run.out_dir) / "checkpoints", self.parallel)
        self.kl_controller = self.pipeline.kl_controller(self.pipeline.kl_coef)  # (init, update) pair
        self.kl_state = self.kl_controller.init()
        self.step_idx, self.version = 0, engine.policy_version
        self.samples_seen = self.tokens_seen = 0

    # ------------------------------------------------------------------ the step, top to bottom
    def step(self) -> dict:
        """One synchronous RL step; returns its metrics (averaged over data-parallel ranks)."""
        timer = _Timer()
        batch, info = self.collect(timer)  # rollout → rewards → shaping → filter (refilled)
        gate, losses = {}, {"update_skipped": 1.0}
        if self.parallel.all_have_rows(batch.batch_size[0]):  # else every rank skips alike
            with timer("logprob"):
                batch, gate = self.prepare(batch)  # critic values, old / reference log-probs, gate
            batch = self.pipeline.transform(batch)  # advantages (and returns)
            with timer("update"):
                losses = self.update(batch)
            with timer("publish"):
                self.publish()
        self.step_idx += 1
        return self._report(batch, timer, {**info, **gate, **losses})

    # ------------------------------------------------------------------ collect
    def _sampling(self, step: int, seed_offset: int = 0, temperature: float | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature or r.temperature,
                              top_p=r.top_p, top_k=r.top_k, eos_id=self.tok.eos_id,
                              seed=self.cfg.run.seed * 7919 + step + seed_offset)

    def _generate(self, samples, sampling: SamplingParams, n: int, group_offset: int = 0) -> TensorDict:
        if self.make_env is not None:  # multi-turn: the environment scores the episode
            from .envs import Limits, run_episodes

            batch, _ = run_episodes(self.engine, self.make_env, samples, self.tok, sampling, n=n,
                                    limits=Limits(max_turns=self.cfg.rollout.max_turns), group_offset=group_offset)
            return batch
        return self.engine.generate([self.task.encode(s) for s in samples], sampling, n, group_offset=group_offset)

    def rewards(self, batch: TensorDict, samples) -> TensorDict:
        """``reward_components`` ``[B, K]`` (one column per task reward; the environment's episode
        reward in multi-turn runs) and ``reward`` = their sum ``[B]``. ``samples[g]`` is group g's."""
        if self.make_env is not None:
            comps = batch["reward"][:, None]
        else:
            fns = self.task.rewards
            rows = zip(batch["tokens"].tolist(), batch["action_mask"].tolist(), batch["group_id"].tolist())
            texts = [(self.tok.decode([t for t, a in zip(toks, act) if a]), samples[g]) for toks, act, g in rows]
            comps = torch.tensor([[float(fn(text, s)) for _, fn in fns] for text, s in texts],
                                 dtype=torch.float32).reshape(len(texts), len(fns))
        return batch.copy().set("reward_components", comps).set("reward", comps.sum(-1))

    def collect(self, timer: _Timer) -> tuple[TensorDict, dict]:
        """This rank's share of ``prompts_per_step`` groups, rewarded and shaped. With a filter the
        batch is refilled — up to ``rollout.max_generation_batches`` generation rounds, fresh
        prompts each round — until it holds the share's number of informative groups; the counts
        are reported (``filter_*``)."""
        r, p = self.cfg.rollout, self.pipeline
        want = len(self.parallel.shard(list(range(r.prompts_per_step))))
        kept, n_groups, dropped, rounds, samples = [], 0, 0, 0, {}
        for attempt in range(r.max_generation_batches if p.filter else 1):
            drawn = self.parallel.shard(self.task.sample(r.prompts_per_step, self.step_idx, attempt=attempt))
            offset = len(samples)
            samples.update({offset + i: s for i, s in enumerate(drawn)})
            with timer("generate"):
                batch = self._generate(drawn, self._sampling(self.step_idx, 10**7 * attempt), r.n, offset)
            with timer("reward"):
                batch = p.admit(self.rewards(batch, samples))
            rounds += 1
            if p.filter is None:
                kept.append(batch)
                break
            batch, d = p.filter(batch)
            dropped += d // r.n
            kept.append(batch)
            n_groups += int(torch.unique(batch["group_id"]).numel()) if batch.batch_size[0] else 0
            if n_groups >= want:
                break
        batch = cat_batches(kept)
        if p.filter is not None and n_groups > want:  # exactly the share: the first `want` groups generated
            batch = batch[torch.isin(batch["group_id"], torch.unique(batch["group_id"])[:want])]
        self._samples = samples
        info = {"filter_rounds": rounds, "filter_dropped_groups": dropped, "filter_kept_groups": min(n_groups, want)}
        return batch, (info if p.filter is not None else {})

    # ------------------------------------------------------------------ prepare
    def _single_pass(self) -> bool:
        """One on-policy pass with no gate, reference or correction: the rollout's own log-probs
        serve as the behaviour policy (the trainer's forward would recompute the same values up to
        float rounding), and the mismatch metrics come from the update's forward — one forward saved."""
        a, p = self.cfg.algo, self.pipeline
        return a.ppo_epochs == 1 and self.cfg.optim.mini_batches == 1 and a.gate_threshold is None and \
            self.reference is None and p.correction is None

    @torch.no_grad()
    def prepare(self, batch: TensorDict) -> tuple[TensorDict, dict]:
        """Add what the pipeline needs: critic ``values``, a greedy ``baseline_reward``, behaviour
        ``old_logprobs`` (checked by the gate), ``ref_logprobs``."""
        out, needs = batch.copy(), self.pipeline.needs
        if self.critic is not None:
            out.set("values", self._no_grad(self.critic, batch))
        if "baseline_reward" in needs:
            out.set("baseline_reward", self._greedy_baseline(batch))
        if self._single_pass():
            return out.set("old_logprobs", batch["rollout_logprobs"]), {}
        lp, _ = self._no_grad(lambda rows: self._logprobs(self.policy, rows), batch)
        mm = T.mismatch_metrics(lp, batch["rollout_logprobs"], batch["action_mask"])
        thr = self.cfg.algo.gate_threshold
        if thr is not None and float(mm["mismatch_max_abs"]) > thr:
            raise GateError(f"step {self.step_idx}: trainer vs rollout log-prob gap {float(mm['mismatch_max_abs']):.3e}"
                            f" > gate {thr:.3e} (mean {float(mm['mismatch_mean_abs']):.3e}); update and publish "
                            f"refused, still serving version {self.version}")
        out.set("old_logprobs", lp)
        if self.reference is not None:
            out.set("ref_logprobs", self._no_grad(lambda rows: self._logprobs(self.reference, rows), batch)[0])
        return out, {k: float(v) for k, v in mm.items()}

    def _no_grad(self, fn, batch: TensorDict):
        """``fn(batch)`` without autograd, micro-batched by ``optim.micro_batch_tokens`` (peak memory
        bounded by the micro-batch, not the rollout batch); the whole batch at once when it is 0."""
        if not self.cfg.optim.micro_batch_tokens:
            return fn(batch)
        return map_micro_batches(fn, batch, self.cfg.optim.micro_batch_tokens, self.parallel)

    def _greedy_baseline(self, batch: TensorDict) -> torch.Tensor:
        """ReMax's baseline: the reward of one near-greedy rollout (temperature 1e-5) per group,
        broadcast to the group's rows ``[B]``."""
        groups = torch.unique(batch["group_id"]).tolist()
        samples = [self._samples[g] for g in groups]
        greedy = self.rewards(self._generate(samples, self._sampling(self.step_idx, 10**8, temperature=1e-5), 1),
                              dict(enumerate(samples)))["reward"]
        by_group = dict(zip(groups, greedy.tolist()))
        return torch.tensor([by_group[g] for g in batch["group_id"].tolist()], dtype=torch.float32)

    def _logprobs(self, model, batch: TensorDict):
        return policy_logprobs(model, batch, self.cfg.rollout.temperature, shared_prefix=self.cfg.optim.shared_prefix,
                               agree=self.parallel.agree_forward())

    # ------------------------------------------------------------------ update, publish
    def loss(self, part: TensorDict, norm: T.Normalizer) -> T.LossOutput:
        """The composed loss of a micro-batch: the policy terms (objective, KL, entropy, correction)
        plus the critic's value term; mismatch metrics from ``transforms.correction``."""
        p = self.pipeline
        lp, ent = self._logprobs(self.policy, part)
        corr = p.correction(part) if p.correction is not None else None
        out = T.policy_loss(part, lp, normalizer=norm, entropy=ent, correction=corr,
                            **p.loss_kwargs(self.kl_state.beta))
        if self._single_pass():
            out = out + T.LossOutput({}, T.mismatch_metrics(lp, part["rollout_logprobs"], part["action_mask"]))
        if self.critic is not None:
            c = self.cfg.algo.critic
            out = out + T.critic_loss(part, self.critic(part), clip=c.value_clip, agg=p.agg, normalizer=norm,
                                      coef=c.value_coef)
        return out

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
        """Publish the policy as version V+1 (all-or-nothing): a refused publication raises
        ``WeightPublishError``; the engine still serves V and the run fails closed."""
        self.publisher.publish(self.policy, self.version + 1)
        self.version += 1

    # ------------------------------------------------------------------ report, evaluate
    def _report(self, batch: TensorDict, timer: _Timer, extra: dict) -> dict:
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
               "response_len_mean": float(m.sum(-1).float().mean())}
        comps = batch["reward_components"] if "reward_components" in batch.keys() else None
        if comps is not None and comps.shape[1] > 1:
            out.update({f"reward_{name}_mean": float(comps[:, k].mean())
                        for k, (name, _) in enumerate(self.task.rewards)})
        return out

    @torch.no_grad()
    def evaluate(self) -> dict:
        samples = self.task.held_out(self.cfg.run.eval_prompts)
        batch = self.engine.generate([self.task.encode(s) for s in samples], self._sampling(0, seed_offset=10**6), 1)
        rewards = [self.task.reward(self.tok.decode(batch["tokens"][i][batch["action_mask"][i]].tolist()), s)
                   for i, s in enumerate(samples)]
        metrics = {"step": self.step_idx, "eval_reward_mean": sum(rewards) / len(rewards)}
        self._emit("eval", metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoint / resume
    def _parts(self) -> dict[str, tuple]:
        """Checkpoint part name → (module, its optimizer part name, optimizer)."""
        mods = {"model": (self.policy, "optim", self.learner.modules["policy"].optimizer)}
        if self.critic is not None:
            mods["critic"] = (self.critic, "critic_optim", self.learner.modules["critic"].optimizer)
        return mods

    def save(self, *, _crash_after: str | None = None) -> Path:
        """Atomic checkpoint: each rank writes its own shards (no gather), rank 0 the marker."""
        state = {"step": self.step_idx, "version": self.version, "samples_seen": self.samples_seen,
                 "tokens_seen": self.tokens_seen, "optim_steps": self.learner.optim_steps,
                 "kl_coef": self.kl_state.beta, "task": self.task.state(), "config": self.cfg.to_dict()}
        path = self.checkpointer.save(self.step_idx, self._parts(), state, _crash_after=_crash_after)
        if self.parallel.rank == 0:
            self._emit("checkpoint", {"step": self.step_idx, "path": str(path)})
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the given (or latest complete) checkpoint — this rank's shards into its local
        parameters and optimizer state — and refit the engine before generating."""
        path = Path(path) if path else self.checkpointer.latest()
        if path is None:
            return False
        st = self.checkpointer.load(path, self._parts())
        self.step_idx, self.samples_seen, self.tokens_seen = st["step"], st["samples_seen"], st["tokens_seen"]
        self.learner.optim_steps = st.get("optim_steps", 0)
        if "kl_coef" in st:
            self.kl_state = type(self.kl_state)(st["kl_coef"])
        self.task.load_state(st.get("task", {}))
        # versions only grow: an engine already past the checkpoint's version gets the next one
        target = st["version"] if self.engine.policy_version < st["version"] else self.engine.policy_version + 1
        self.publisher.publish(self.policy, target)  # refit before the first generation
        self.version = target
        return True

    def _emit(self, event: str, metrics: dict) -> None:
        for h in self.hooks:
            h(event, self, metrics)


def write_jsonl(path: Path):
    """A hook appending every step/eval record to ``path`` as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(event, trainer, metrics):
        if event in ("step", "eval"):
            with path.open("a") as f:
                f.write(json.dumps({"event": event, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                       for k, v in metrics.items()}}) + "\n")

    return hook
