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
``"step"``, ``"eval"``, ``"checkpoint"``, ``"completions"`` (``run.log_completions``).
"""

from __future__ import annotations

import dataclasses
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
from .device import compute_context, torch_dtype
from .forward import packed_logprobs_and_entropy, policy_logprobs
from .learner import Learner, Optimized, map_micro_batches
from .lora import MergedView, TrainableView, is_lora, trainable_parameters
from .parallel import LocalParallel, make_parallel
from .recipes import Pipeline, build_pipeline
from .rewards import Reward, RewardSet
from .rollout.requests import Request
from .sampling import SamplingParams
from .sharding.publisher import Publisher
from .tokenizer import decode_response
from .trajectory import cat_batches

__all__ = ["SyncTrainer", "GateError", "ValueModel", "write_jsonl", "write_completions"]


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


@contextmanager
def _eval_mode(module: torch.nn.Module):
    """``module.eval()`` inside, its previous mode restored after."""
    was = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was)


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
                 hooks=(), reference=None, critic=None, make_env=None, parallel: LocalParallel | None = None,
                 rewards: RewardSet | None = None):
        self.cfg, self.policy, self.engine, self.tok, self.task = cfg, policy, engine, tokenizer, task
        self._rewards = rewards  # the config's ``rewards:``; None = the task's (or the environment's)
        self.pipeline = pipeline or build_pipeline(cfg.algo)
        needs = self.pipeline.needs
        if "ref_logprobs" in needs and reference is None:
            raise ValueError("algo.kl.coef > 0 needs a reference model (pass reference=...; hyperrl train builds one)")
        if "values" in needs and critic is None:
            raise ValueError(f"algo.advantage={cfg.algo.advantage.name!r} needs a critic's values (pass "
                             "critic=ValueModel(...); hyperrl train builds one)")
        if "token_rewards" in needs and make_env is not None:
            raise ValueError(f"algo.advantage={cfg.algo.advantage.name!r} needs per-token step rewards, which a "
                             "multi-turn run (env) does not produce; use an outcome advantage (grpo, rloo, …)")
        if cfg.algo.proximal == "interpolate" and cfg.algo.gate_threshold is not None:
            raise ValueError("algo.proximal=interpolate skips the proximal forward the bit-exact gate "
                             "(algo.gate_threshold) compares; use proximal: recompute with the gate")
        self.reference, self.critic, self.make_env = reference, critic, make_env
        self.device = next(policy.parameters()).device
        self._dtypes = (torch_dtype(cfg.model.dtype), torch_dtype(cfg.model.param_dtype))
        self.hooks = list(hooks)
        self.parallel = parallel or make_parallel()
        o, a = cfg.optim, cfg.algo
        self.lora = is_lora(policy)  # adapters train; publication merges them; checkpoints hold them only
        parts = {"policy": Optimized(policy, torch.optim.AdamW(trainable_parameters(policy), lr=o.lr, betas=o.betas,
                                                               weight_decay=o.weight_decay), o.lr)}
        if critic is not None:
            parts["critic"] = Optimized(critic, torch.optim.AdamW(critic.parameters(), lr=a.critic.lr), a.critic.lr)
        self.learner = Learner(parts, grad_clip=o.grad_clip, schedule=o.schedule, warmup=o.warmup_steps,
                               min_lr_ratio=o.min_lr_ratio, total_steps=cfg.run.steps * o.mini_batches * a.ppo_epochs,
                               parallel=self.parallel)
        # what the engine receives: the adapters (an engine serving LoRA), or full weights by HF name
        self._adapters_only = self.lora and getattr(engine, "accepts_lora", False)
        self._published = MergedView(policy) if self.lora else policy
        self.publisher = Publisher.for_engine(self._published, engine, rank=self.parallel.rank,
                                              world=self.parallel.world)
        self.checkpointer = Checkpointer(Path(cfg.run.out_dir) / "checkpoints", self.parallel,
                                         keep_last_k=cfg.run.keep_last_k)
        self.kl_controller = self.pipeline.kl_controller(self.pipeline.kl_coef)  # (init, update) pair
        self.kl_state = self.kl_controller.init()
        self.step_idx, self.version = 0, engine.policy_version
        self._reward_extra: dict[str, float] = {}  # a verl dict reward's extra keys, per step
        # a chat model may end a turn with a token besides eos_token (generation_config lists them all)
        gen_eos = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
        self._stop_ids = tuple(int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else
                                                ([gen_eos] if gen_eos is not None else [])))
        self.samples_seen = self.tokens_seen = 0

    # ------------------------------------------------------------------ the step, top to bottom
    def step(self) -> dict:
        """One synchronous RL step; returns its metrics (averaged over data-parallel ranks)."""
        timer = _Timer()
        batch, info = self.collect(timer)  # rollout → rewards → shaping → filter (refilled)
        batch = batch.to(self.device)
        gate, losses = {}, {"update_skipped": 1.0}
        if self.parallel.all_have_rows(batch.batch_size[0]):  # else every rank skips alike
            with timer("logprob"):
                batch, gate = self.prepare(batch)  # critic values, old / reference log-probs, gate
            batch = self.pipeline.transform(batch)  # advantages (and returns)
            with timer("update"):
                losses = self.update(batch)
            with timer("publish"):
                self.publish()
        if self.cfg.run.log_completions and self.parallel.rank == 0:
            self._emit("completions", {"step": self.step_idx + 1, "rows": self._completions(batch)})
        self.step_idx += 1
        return self._report(batch, timer, {**info, **gate, **losses})

    # ------------------------------------------------------------------ collect
    def _sampling(self, step: int, seed_offset: int = 0, temperature: float | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature or r.temperature,
                              top_p=r.top_p, top_k=r.top_k, eos_id=self.tok.eos_token_id, stop_ids=self._stop_ids,
                              seed=self.cfg.run.seed * 7919 + step + seed_offset)

    def sample_uid(self, step: int, attempt: int, prompt: int, sample: int) -> int:
        """The ``sample_uid`` of sample ``j`` of global prompt ``g`` in generation round ``attempt``
        of ``step``: unique over the run and a pure function of those — resume needs no state."""
        r = self.cfg.rollout
        return ((step * r.max_generation_batches + attempt) * r.prompts_per_step + prompt) * r.n + sample

    def _uids(self, attempt: int) -> list[int]:
        """This rank's ``sample_uid`` of every row of a training generation round."""
        r = self.cfg.rollout
        return [self.sample_uid(self.step_idx, attempt, g, j)
                for g in self.parallel.shard(list(range(r.prompts_per_step))) for j in range(r.n)]

    def _generate(self, samples, sampling: SamplingParams, n: int, group_offset: int = 0, *,
                  uids: list[int] | None = None) -> TensorDict:
        """Rollout of ``n`` samples per prompt. Training rounds (``uids`` given) on an engine with
        keyed resumable requests sample keyed by (seed, sample_uid, token index) — what an asynchronous
        run does too, so the two agree at η = 0; the seed is then the run's (the step enters
        through the uid)."""
        if self.make_env is not None:  # multi-turn: the environment scores the episode
            from .envs import Limits, run_episodes

            r = self.cfg.rollout
            limits = Limits(max_turns=r.max_turns, max_obs_tokens=r.max_obs_tokens,
                            max_episode_tokens=r.max_episode_tokens)
            batch, _ = run_episodes(self.engine, self.make_env, samples, self.tok, sampling, n=n, limits=limits,
                                    group_offset=group_offset)
            return batch
        prompts = [self.task.encode(s) for s in samples]
        if uids is not None and getattr(self.engine, "keyed", False):
            reqs = [Request(u, tuple(p), group_offset + i) for (i, p), u in
                    zip([(i, p) for i, p in enumerate(prompts) for _ in range(n)], uids)]
            return self.engine.generate_requests(reqs, dataclasses.replace(sampling, seed=self._keyed_seed(sampling)))
        return self.engine.generate(prompts, sampling, n, group_offset=group_offset)

    def _keyed_seed(self, sampling: SamplingParams) -> int:
        """The run's sampling seed without the step (keyed sampling takes the step from the uid)."""
        return sampling.seed - self.step_idx

    @property
    def reward_set(self) -> RewardSet | None:
        """The rewards scored on each completion: the config's ``rewards:``, else the task's named
        rewards (hyperrl style); None in a multi-turn run without configured rewards (the
        environment's episode reward alone)."""
        if self._rewards is not None:
            return self._rewards
        if self.make_env is not None:
            return None
        return RewardSet(tuple(Reward(name, fn, "hyperrl") for name, fn in self.task.rewards))

    @property
    def reward_names(self) -> tuple[str, ...]:
        rs = self.reward_set
        return (("env",) if self.make_env is not None else ()) + (rs.names if rs is not None else ())

    def rewards(self, batch: TensorDict, samples) -> TensorDict:
        """``reward_components`` ``[B, K]`` (the environment's episode reward first in multi-turn
        runs, then one column per reward; 0 where a reward does not apply, ``reward_applicable``
        says where it does) and ``reward`` = their weighted sum ``[B]``. ``samples[g]`` is group g's."""
        ids = [[t for t, a in zip(toks, act) if a] for toks, act in zip(batch["tokens"].tolist(),
                                                                       batch["action_mask"].tolist())]
        rows = [samples[g] for g in batch["group_id"].tolist()]
        comps, app, weights = [], [], []
        if self.make_env is not None:
            comps.append(batch["reward"].float()[:, None])
            app.append(torch.ones(len(ids), 1, dtype=torch.bool))
            weights.append(torch.ones(1))
        rs = self.reward_set
        if rs is not None:
            seen: dict[tuple, str] = {}  # a group's samples often repeat a response: decode each once
            for i in ids:
                if tuple(i) not in seen:
                    seen[tuple(i)] = decode_response(self.tok, i, self._stop_ids)
            texts = [seen[tuple(i)] for i in ids]
            c, a, extra = rs.score([s.prompt for s in rows], texts, ids, rows)
            comps.append(c)
            app.append(a)
            weights.append(rs.weights)
            self._reward_extra.update(extra)
        comps, app = torch.cat(comps, -1), torch.cat(app, -1)
        total = (comps * torch.cat(weights)).sum(-1)
        out = batch.copy().set("reward_components", comps).set("reward_applicable", app).set("reward", total)
        if "token_rewards" in self.pipeline.needs:
            out.set("token_rewards", self._token_rewards(batch, ids, rows, comps, app))
        return out

    def _token_rewards(self, batch: TensorDict, ids: list[list[int]], rows: list, comps, app) -> torch.Tensor:
        """``token_rewards`` ``[B, T]`` on the action tokens (:meth:`RewardSet.token_rewards`);
        they sum to each row's ``reward``."""
        stops = {self.tok.eos_token_id, *self._stop_ids}
        pieces = [[None if t in stops else decode_response(self.tok, [t]) for t in row] for row in ids]
        credit = self.reward_set.token_rewards(pieces, rows, comps, app)
        out = torch.zeros(batch["action_mask"].shape, dtype=torch.float32)
        m = batch["action_mask"].bool()
        out[m] = torch.tensor([v for row in credit for v in row], dtype=torch.float32)
        return out

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
                batch = self._generate(drawn, self._sampling(self.step_idx, 10**7 * attempt), r.n, offset,
                                       uids=self._uids(attempt))
            with timer("reward"):
                batch = p.admit(self.rewards(batch, samples))
                if "token_rewards" in batch.keys():  # what shaping changed in `reward` lands on the last token
                    tr = batch["token_rewards"]
                    batch = batch.copy().set("token_rewards", tr + T.scores_to_token_rewards(
                        batch["reward"] - tr.sum(-1), batch["action_mask"]))
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
            out.set("values", self._no_grad(self._values, batch))
        if "baseline_reward" in needs:
            out.set("baseline_reward", self._greedy_baseline(batch))
        if self._single_pass() or self.cfg.algo.proximal == "interpolate":  # (A-3PO: old_logprobs set in loss)
            return out.set("old_logprobs", batch["rollout_logprobs"]), {}
        with _eval_mode(self.policy):  # no dropout (LoRA's) in the behaviour / reference log-probs
            lp, _ = self._no_grad(lambda rows: self._logprobs(self.policy, rows), batch)
        mm = T.mismatch_metrics(lp, batch["rollout_logprobs"], batch["action_mask"])
        thr = self.cfg.algo.gate_threshold
        if thr is not None and float(mm["mismatch_max_abs"]) > thr:
            raise GateError(f"step {self.step_idx}: trainer vs rollout log-prob gap {float(mm['mismatch_max_abs']):.3e}"
                            f" > gate {thr:.3e} (mean {float(mm['mismatch_mean_abs']):.3e}); update and publish "
                            f"refused, still serving version {self.version}")
        out.set("old_logprobs", lp)
        if self.reference is not None:
            with _eval_mode(self.policy):
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

    def _amp(self):
        """Mixed precision of every trainer forward (``model.dtype`` over ``model.param_dtype``)."""
        return compute_context(self.device, *self._dtypes)

    def _logprobs(self, model, batch: TensorDict):
        # gradient checkpointing drops the KV cache inside checkpointed layers: plain forward then
        shared = self.cfg.optim.shared_prefix and not self.cfg.model.gradient_checkpointing
        with self._amp():
            if self.cfg.optim.pack_tokens:
                return packed_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                   self.cfg.optim.pack_tokens)
            return policy_logprobs(model, batch, self.cfg.rollout.temperature, shared_prefix=shared,
                                   agree=self.parallel.agree_forward())

    def _values(self, batch: TensorDict) -> torch.Tensor:
        with self._amp():
            return self.critic(batch).float()

    # ------------------------------------------------------------------ update, publish
    def loss(self, part: TensorDict, norm: T.Normalizer) -> T.LossOutput:
        """The composed loss of a micro-batch: the policy terms (objective, KL, entropy, correction)
        plus the critic's value term; mismatch metrics from ``transforms.correction``."""
        p = self.pipeline
        lp, ent = self._logprobs(self.policy, part)
        if self.cfg.algo.proximal == "interpolate":  # A-3PO: π_prox from the token versions, no proximal forward
            part = part.copy().set("old_logprobs", T.interpolated_proximal_logprobs(
                part["rollout_logprobs"], lp, part["token_version"], part["action_mask"], self.version))
        corr = p.correction(part) if p.correction is not None else None
        out = T.policy_loss(part, lp, normalizer=norm, entropy=ent, correction=corr,
                            **p.loss_kwargs(self.kl_state.beta))
        if self._single_pass():
            out = out + T.LossOutput({}, T.mismatch_metrics(lp, part["rollout_logprobs"], part["action_mask"]))
        if self.critic is not None:
            c = self.cfg.algo.critic
            out = out + T.critic_loss(part, self._values(part), clip=c.value_clip, agg=p.agg, normalizer=norm,
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
        self._publish_as(self.version + 1)
        self.version += 1

    def _publish_as(self, version: int) -> None:
        if self._adapters_only:
            self.engine.load_lora(self.policy, version)
        else:
            self.publisher.publish(self._published, version)

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
        if "tool_calls" in batch.keys():  # multi-turn: how often the policy used a tool
            calls = batch["tool_calls"].float()
            out["tool_call_rate"], out["tool_calls_mean"] = float((calls > 0).float().mean()), float(calls.mean())
        if "success" in batch.keys():  # the environment's verdict, whatever reward shaping adds
            out["success_rate"] = float(batch["success"].float().mean())
        comps = batch["reward_components"] if "reward_components" in batch.keys() else None
        if comps is not None and comps.shape[1] > 1:  # each reward over the rows it applies to
            app = batch["reward_applicable"]
            for k, name in enumerate(self.reward_names):
                if bool(app[:, k].any()):
                    out[f"reward_{name}_mean"] = float(comps[:, k][app[:, k]].mean())
                out[f"reward_{name}_applicable_frac"] = float(app[:, k].float().mean())
        out.update(self._reward_extra)
        self._reward_extra = {}
        return out

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out evaluation that runs what training runs — the task's validation prompts, the
        environment (multi-turn) and the configured rewards — with ``run.eval_n`` samples per
        prompt: ``eval_reward_mean`` (mean@k), ``eval_pass_at_k`` (the mean over prompts of the best
        sample's reward: pass@k for 0/1 rewards), each reward's mean; multi-turn: the tool-call
        rate and, when the environment reports it, ``eval_success_rate`` (episodes solved). Data
        parallel: each rank evaluates its share of the prompts and the sums are all-reduced (exact means)."""
        k = self.cfg.run.eval_n
        samples = self.parallel.shard(self.task.held_out(self.cfg.run.eval_prompts))
        sums: dict[str, float] = {}
        if samples:
            batch = self._generate(samples, self._sampling(0, seed_offset=10**6), k)
            batch = self.rewards(batch, dict(enumerate(samples)))
            self._reward_extra = {}
            r, g = batch["reward"], batch["group_id"]
            best = torch.full((len(samples),), float("-inf")).scatter_reduce(0, g, r, "amax")
            sums = {"rows": r.numel(), "prompts": len(samples), "reward": float(r.sum()), "best": float(best.sum()),
                    "len": float(batch["action_mask"].sum())}
            if "tool_calls" in batch.keys():
                sums["tool_rows"] = float((batch["tool_calls"] > 0).sum())
            if "success" in batch.keys():
                sums["success"] = float(batch["success"].sum())
            comps, app = batch["reward_components"], batch["reward_applicable"]
            if comps.shape[1] > 1:
                for j, name in enumerate(self.reward_names):
                    sums[f"r/{name}"] = float(comps[:, j][app[:, j]].sum())
                    sums[f"n/{name}"] = float(app[:, j].sum())
        sums = self.parallel.sum_metrics(sums)
        rows, prompts = sums.get("rows", 0.0), sums.get("prompts", 0.0)
        if not rows:
            raise ValueError("evaluation: the task returned no held-out prompts (check run.eval_prompts and the "
                             "validation data)")
        metrics = {"step": self.step_idx, "eval_reward_mean": sums["reward"] / rows,
                   "eval_pass_at_k": sums["best"] / prompts, "eval_n": k, "eval_response_len_mean": sums["len"] / rows}
        if "tool_rows" in sums:
            metrics["eval_tool_call_rate"] = sums["tool_rows"] / rows
        if "success" in sums:
            metrics["eval_success_rate"] = sums["success"] / rows
        for key in sorted(sums):
            if key.startswith("r/") and sums[f"n/{key[2:]}"]:
                metrics[f"eval_reward_{key[2:]}_mean"] = sums[key] / sums[f"n/{key[2:]}"]
        self._emit("eval", metrics)
        return metrics

    def _completions(self, batch: TensorDict) -> list[dict]:
        """``run.log_completions`` rows of this step: prompt and completion text (everything after the
        prompt, observations included), reward, each reward component, the mean advantage."""
        k = min(self.cfg.run.log_completions, batch.batch_size[0])
        rows = []
        for i in range(k):
            act, n = batch["action_mask"][i], int(batch["attention_mask"][i].sum())
            p = int(act.int().argmax()) if bool(act.any()) else n
            toks = batch["tokens"][i].tolist()
            adv = batch["advantages"][i][act] if "advantages" in batch.keys() else torch.zeros(1)
            rows.append({"prompt": self.tok.decode(toks[:p], skip_special_tokens=True),  # for reading only
                         "completion": decode_response(self.tok, toks[p:n]), "reward": float(batch["reward"][i]),
                         "group_id": int(batch["group_id"][i]),
                         "advantage": float(adv.float().mean()) if adv.numel() else 0.0,
                         **{f"reward_{name}": float(batch["reward_components"][i, j])
                            for j, name in enumerate(self.reward_names)}})
        return rows

    # ------------------------------------------------------------------ checkpoint / resume
    def _parts(self) -> dict[str, tuple]:
        """Checkpoint part name → (module, its optimizer part name, optimizer)."""
        policy = TrainableView(self.policy) if self.lora else self.policy
        mods = {"model": (policy, "optim", self.learner.modules["policy"].optimizer)}
        if self.critic is not None:
            mods["critic"] = (self.critic, "critic_optim", self.learner.modules["critic"].optimizer)
        return mods

    def save(self, *, _crash_after: str | None = None) -> Path:
        """Atomic checkpoint: each rank writes its own shards (no gather), rank 0 the marker."""
        state = {"step": self.step_idx, "version": self.version, "samples_seen": self.samples_seen,
                 "tokens_seen": self.tokens_seen, "optim_steps": self.learner.optim_steps,
                 "kl_coef": self.kl_state.beta, "task": self.task.state(), "config": self.cfg.to_dict(),
                 **self._loop_state()}
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
        self._load_loop_state(st)
        # versions only grow: an engine already past the checkpoint's version gets the next one
        target = st["version"] if self.engine.policy_version < st["version"] else self.engine.policy_version + 1
        self._publish_as(target)  # refit before the first generation
        self.version = target
        return True

    def _loop_state(self) -> dict:
        """What a loop beyond the synchronous one adds to the checkpoint's state (none here)."""
        return {}

    def _load_loop_state(self, state: dict) -> None:
        pass

    def _emit(self, event: str, metrics: dict) -> None:
        for h in self.hooks:
            h(event, self, metrics)


def write_completions(path: Path):
    """A hook appending each step's logged completions (``run.log_completions``) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(event, trainer, metrics):
        if event == "completions":
            with path.open("a") as f:
                for row in metrics["rows"]:
                    f.write(json.dumps({"step": metrics["step"], **row}) + "\n")

    return hook


def write_jsonl(path: Path):
    """A hook appending every step/eval record to ``path`` as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(event, trainer, metrics):
        if event in ("step", "eval"):
            with path.open("a") as f:
                f.write(json.dumps({"event": event, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                       for k, v in metrics.items()}}) + "\n")

    return hook
