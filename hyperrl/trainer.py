"""The thin SyncTrainer: rollout → reward → transforms → update → publish → eval → checkpoint.

It holds the only mutable state (policy, optimizer, step, version); the math comes from
``hyperrl.transforms`` (by registry name, or a user-supplied chained transform); weights reach the
engine through a ``hyperrl.sharding`` plan (an identity layout in one process). Users observe
through hooks ``hook(event, trainer, metrics)``; events: ``"step"``, ``"eval"``, ``"checkpoint"``.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

from . import transforms as T
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, rng_states, save_checkpoint, set_rng_states
from .config import TrainConfig
from .forward import policy_logprobs
from .rollout.base import SamplingParams
from .schedules import SCHEDULES, lr_multiplier
from .sharding import Layout, Mesh, Placement, Spec, plain_destination, reshard_plan
from .sharding.dtensor import from_placements
from .sharding.execute import execute_direct

__all__ = ["SyncTrainer", "GateError", "ValueModel", "default_transform"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


def default_transform(algo) -> Callable[[TensorDict], TensorDict]:
    """The configured advantage pipeline as one chained transform (batch → batch)."""
    if algo.estimator == "gae":
        return T.chain(T.bind(T.compute_advantages, estimator="gae", gamma=algo.gamma, lam=algo.lam,
                              whiten=algo.whiten_advantages))
    kw = {"eps": algo.eps} if algo.estimator in ("grpo", "batch_std", "grpo_passk") else {}
    return T.chain(T.bind(T.compute_advantages, estimator=algo.estimator, **kw))


class _Timer:
    def __init__(self):
        self.t: dict[str, float] = {}

    @contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.t[f"time_{name}_s"] = self.t.get(f"time_{name}_s", 0.0) + time.perf_counter() - t0


class SyncTrainer:
    def __init__(self, cfg: TrainConfig, *, policy, engine, tokenizer, task, transform=None, hooks=(),
                 reference=None, critic=None):
        self.cfg, self.policy, self.engine, self.tok, self.task = cfg, policy, engine, tokenizer, task
        T.ADVANTAGES.get(cfg.algo.estimator)
        T.OBJECTIVES.get(cfg.algo.objective)
        T.AGGREGATIONS.get(cfg.algo.agg)
        if cfg.algo.kl_coef > 0 and reference is None:
            raise ValueError("algo.kl_coef > 0 needs a reference model (pass reference=...)")
        self.reference = reference
        if cfg.algo.estimator == "gae" and critic is None:
            raise ValueError("algo.estimator=gae needs a critic (pass critic=ValueModel(...); "
                             "hyperrl train builds one)")
        self.critic = critic
        self.critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.algo.critic_lr) if critic else None
        self.transform = transform or default_transform(cfg.algo)
        self.hooks = list(hooks)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        SCHEDULES.get(o.schedule)
        self.optim_steps = 0  # the lr schedule's only state
        self.step_idx, self.version = 0, engine.policy_version
        self.samples_seen = self.tokens_seen = 0
        self.out = Path(cfg.run.out_dir)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
        self._plan = self._publish_plan()

    # ------------------------------------------------------------------ the step, top to bottom
    def step(self) -> dict:
        cfg, timer = self.cfg, _Timer()
        samples = self.task.sample(cfg.rollout.prompts_per_step, self.step_idx)
        samples = samples[self.rank::self.world]  # data parallel: each rank rolls out its share
        with timer("generate"):
            batch = self._generate(samples)
        with timer("reward"):
            batch = self._rewards(batch, samples)
        gate, losses = {}, {"update_skipped": 1.0}
        if self._all_ranks_have_rows(batch):  # else (e.g. all groups filtered) every rank skips alike
            if self.critic is not None:
                with timer("values"), torch.no_grad():
                    batch = batch.copy().set("values", self.critic(batch))
            batch = self.transform(batch)
            with timer("logprob"):
                batch, gate = self._old_logprobs(batch)
            with timer("update"):
                losses = self._update(batch)
            with timer("publish"):
                self.publish()
        self.step_idx += 1
        self.samples_seen += batch.batch_size[0]
        self.tokens_seen += int(batch["attention_mask"].sum())
        metrics = {"step": self.step_idx, "policy_version": self.version, **self._batch_metrics(batch), **gate,
                   **losses, **timer.t}
        metrics["tokens_per_s"] = int(batch["attention_mask"].sum()) / max(sum(timer.t.values()), 1e-9)
        metrics = self._mean_over_ranks(metrics)
        self._emit("step", metrics)
        return metrics

    # ------------------------------------------------------------------ pieces
    def _sampling(self, step: int, seed_offset: int = 0) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, eos_id=self.tok.eos_id, seed=self.cfg.run.seed * 7919 + step + seed_offset)

    def _generate(self, samples) -> TensorDict:
        cfg = self.cfg
        if cfg.task.environment:  # multi-turn: the environment scores the episode
            from .envs import ENVIRONMENTS, Limits, run_episodes

            make_env = ENVIRONMENTS.get(cfg.task.environment)
            batch, _ = run_episodes(self.engine, make_env, samples, self.tok, self._sampling(self.step_idx),
                                    n=cfg.rollout.n, limits=Limits(max_turns=cfg.task.max_turns))
            return batch
        return self.engine.generate([self.task.encode(s) for s in samples], self._sampling(self.step_idx),
                                    cfg.rollout.n)

    def _rewards(self, batch: TensorDict, samples) -> TensorDict:
        n = self.cfg.rollout.n
        if self.cfg.task.environment:
            r = batch["reward"]
        else:
            rows = zip(batch["tokens"].tolist(), batch["action_mask"].tolist())
            r = torch.tensor([self.task.reward(self.tok.decode([t for t, a in zip(toks, act) if a]), samples[i // n])
                              for i, (toks, act) in enumerate(rows)], dtype=torch.float32)
        if self.cfg.algo.overlong_buffer:
            r = r + T.overlong_penalty(batch["action_mask"].sum(-1), max_len=self.cfg.rollout.max_new_tokens,
                                       buffer=self.cfg.algo.overlong_buffer)
        out = batch.copy().set("reward", r)
        if self.cfg.algo.dynamic_sampling:
            out, _ = T.dynamic_sampling_filter(out)
        return out

    def _single_pass(self) -> bool:
        """One on-policy pass with no gate and no reference: the rollout's own log-probs serve as the
        behaviour policy (the trainer's forward would recompute the same values up to float
        rounding), and the mismatch metrics come from the update's forward — one forward saved."""
        a = self.cfg.algo
        return a.ppo_epochs == 1 and self.cfg.optim.mini_batches == 1 and a.gate_threshold is None and \
            self.reference is None

    def _all_ranks_have_rows(self, batch: TensorDict) -> bool:
        if self.world == 1:
            return batch.batch_size[0] > 0
        t = torch.tensor([batch.batch_size[0]])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t) > 0

    @torch.no_grad()
    def _old_logprobs(self, batch: TensorDict):
        if self._single_pass():
            return batch.copy().set("old_logprobs", batch["rollout_logprobs"]), {}
        lp, _ = self._logprobs(self.policy, batch)
        mm = T.mismatch_metrics(lp, batch["rollout_logprobs"], batch["action_mask"])
        thr = self.cfg.algo.gate_threshold
        if thr is not None and float(mm["mismatch_max_abs"]) > thr:
            raise GateError(f"step {self.step_idx}: trainer vs rollout log-prob gap {float(mm['mismatch_max_abs']):.3e}"
                            f" > gate {thr:.3e} (mean {float(mm['mismatch_mean_abs']):.3e}); update and publish "
                            f"refused, still serving version {self.version}")
        out = batch.copy().set("old_logprobs", lp)
        if self.reference is not None:
            out.set("ref_logprobs", self._logprobs(self.reference, batch)[0])
        return out, {k: float(v) for k, v in mm.items()}

    def _logprobs(self, model, batch: TensorDict):
        return policy_logprobs(model, batch, self.cfg.rollout.temperature,
                                    shared_prefix=self.cfg.optim.shared_prefix,
                                    agree=self._agree if self.world > 1 else None)

    @staticmethod
    def _agree(use: bool, S: int) -> tuple[bool, int]:
        """One forward choice for all data-parallel ranks (FSDP needs the same model calls on each)."""
        t = torch.tensor([int(not use), S])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return not bool(t[0]), int(t[1])

    def _micro_batches(self, mini: TensorDict) -> list:
        """Micro-batches of a mini-batch by token budget; across ranks padded to one count with
        ``None`` (a zero-weight pass: FSDP needs the same forwards/backwards on every rank)."""
        lengths = mini["attention_mask"].sum(-1)
        micros = []
        if len(lengths):
            budget = self.cfg.optim.micro_batch_tokens or int(lengths.sum())
            micros = T.micro_batches_by_token_budget(lengths, max(budget, int(lengths.max())))
        if self.world > 1:
            t = torch.tensor([len(micros)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            micros += [None] * (int(t) - len(micros))
        return micros

    def _update(self, batch: TensorDict) -> dict:
        a, o = self.cfg.algo, self.cfg.optim
        B = batch.batch_size[0]
        totals: dict[str, float] = {}
        order = torch.randperm(B, generator=torch.Generator().manual_seed(self.cfg.run.seed + self.step_idx))
        for _ in range(a.ppo_epochs):
            for mb in order.tensor_split(o.mini_batches):  # the same count on every rank, maybe empty
                mini = batch[mb]
                norm = self._global(T.Normalizer.from_mask(mini["action_mask"],
                                                            length_const=self.cfg.rollout.max_new_tokens))
                for micro in self._micro_batches(mini):
                    if micro is None:  # this rank has run out: a zero-weight pass keeps FSDP in step
                        lp, ent = self._logprobs(self.policy, batch[:1])
                        zero = (lp.sum() + ent.sum()) * 0.0
                        if self.critic is not None:
                            zero = zero + self.critic(batch[:1]).sum() * 0.0
                        zero.backward()
                        continue
                    part = mini[torch.tensor(micro)]
                    lp, ent = self._logprobs(self.policy, part)
                    out = T.policy_loss(part, lp, objective=a.objective, agg=a.agg, normalizer=norm, entropy=ent,
                                        entropy_coef=a.entropy_coef, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                                        **self._objective_kwargs())
                    if self.critic is not None:
                        v = T.critic_loss(part, self.critic(part), clip=a.value_clip, agg=a.agg, normalizer=norm,
                                          coef=a.value_coef)
                        out = T.LossOutput({**out.terms, **v.terms}, {**out.metrics, **v.metrics})
                    (out.loss * self.world).backward()  # FSDP averages over ranks; the normaliser is global
                    if self._single_pass():
                        d = (lp.detach() - part["rollout_logprobs"])[part["action_mask"]]
                        if d.numel():
                            totals["mismatch_max_abs"] = max(totals.get("mismatch_max_abs", 0.0),
                                                             float(d.abs().max()))
                            totals["mismatch_mean_abs"] = totals.get("mismatch_mean_abs", 0.0) + \
                                float(d.abs().mean()) * len(micro) / B
                            totals["mismatch_k3"] = totals.get("mismatch_k3", 0.0) + \
                                float((torch.expm1(-d) + d).mean()) * len(micro) / B
                    w = len(micro) / B / a.ppo_epochs
                    for k, v in out.scalars().items():
                        totals[k] = totals.get(k, 0.0) + v * w
                gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), o.grad_clip)
                gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
                totals["grad_norm"] = max(totals.get("grad_norm", 0.0), float(gn))
                totals["lr"] = self._set_lr()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    torch.nn.utils.clip_grad_norm_(self.critic.parameters(), o.grad_clip)
                    self.critic_opt.step()
                    self.critic_opt.zero_grad(set_to_none=True)
        return totals

    def _set_lr(self) -> float:
        """Learning rates for optimizer step ``optim_steps`` of the run (policy and critic), from the schedule."""
        o, a = self.cfg.optim, self.cfg.algo
        total = self.cfg.run.steps * o.mini_batches * a.ppo_epochs
        m = lr_multiplier(self.optim_steps, schedule=o.schedule, total=max(total, 1), warmup=o.warmup_steps,
                          min_ratio=o.min_lr_ratio)
        for opt, base in ((self.optimizer, o.lr), (self.critic_opt, a.critic_lr)):
            for g in (opt.param_groups if opt is not None else ()):
                g["lr"] = base * m
        self.optim_steps += 1
        return o.lr * m

    def _global(self, norm):
        """Sum the step's normalisers over data-parallel ranks (exact gradient accumulation)."""
        if self.world == 1:
            return norm
        t = torch.tensor([float(norm.num_tokens), float(norm.num_seqs)])
        dist.all_reduce(t)
        return T.Normalizer(t[0], t[1], norm.length_const)

    def _objective_kwargs(self) -> dict:
        """The config scalars the registered objective accepts (by keyword name), nothing else."""
        accepted = inspect.signature(T.OBJECTIVES.get(self.cfg.algo.objective)).parameters
        return {k: getattr(self.cfg.algo, k) for k in ("clip_low", "clip_high") if k in accepted}

    def _publish_plan(self):
        """Source: the policy's parameters as they are sharded (FSDP2 DTensors → specs; a single
        process is the identity layout). Destination: every rank's engine holds a full replica."""
        names = dict(self.policy.named_parameters())
        src_mesh = Mesh.of(fsdp=self.world)
        placements = {}
        for k, p in names.items():
            spec = from_placements(p.placements, src_mesh, p.dim()) if hasattr(p, "placements") \
                else Spec.replicate(p.dim())
            placements[k] = Placement(tuple(p.shape), p.dtype, spec, src_mesh)
        dst = plain_destination({k: (tuple(p.shape), p.dtype, Spec.replicate(p.dim())) for k, p in names.items()},
                                Mesh.of(dp=self.world))
        return reshard_plan(Layout(placements), dst)

    def _through_plan(self) -> dict[str, torch.Tensor]:
        local = {k: _local(p).detach() for k, p in self.policy.named_parameters()}
        if self.world == 1:  # the identity plan: each transfer is a whole tensor — pass views, copy nothing
            out = {}
            for t in self._plan:
                view = local[t.tensor][t.src_slice.slices()]
                if tuple(view.shape) != tuple(local[t.tensor].shape):
                    raise RuntimeError(f"{t.param}: a one-process plan must move whole tensors, got {t.src_slice}")
                out[t.param] = view
            return out
        out = {k: torch.empty(tuple(p.shape), dtype=p.dtype) for k, p in self.policy.named_parameters()}
        execute_direct(self._plan, self.rank, local, out)
        return out

    def publish(self) -> None:
        """Publish the policy as version V+1 through the reshard plan (direct-reshard across
        processes; the identity layout in one); all-or-nothing. A refused publication raises
        :class:`WeightPublishError`: the engine still serves V and the run fails closed."""
        self.engine.load_weights(self._through_plan(), version=self.version + 1)
        self.version += 1

    def _batch_metrics(self, batch: TensorDict) -> dict:
        if batch.batch_size[0] == 0:
            return {"reward_mean": float("nan")}
        r, m = batch["reward"], batch["action_mask"]
        g = T.group_stats(r, batch["group_id"])
        adv = batch["advantages"][m] if "advantages" in batch.keys() else torch.zeros(1)
        return {"reward_mean": float(r.mean()), "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
                "zero_variance_group_frac": float(g.constant.float().mean()), "adv_mean": float(adv.mean()),
                "adv_std": float(adv.std()) if adv.numel() > 1 else 0.0, "adv_max_abs": float(adv.abs().max()),
                "response_len_mean": float(m.sum(-1).float().mean())}

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
    def _modules(self) -> dict[str, tuple]:
        """Checkpoint part name → (module, its optimizer part name, optimizer)."""
        mods = {"model": (self.policy, "optim", self.optimizer)}
        if self.critic is not None:
            mods["critic"] = (self.critic, "critic_optim", self.critic_opt)
        return mods

    def save(self, *, _crash_after: str | None = None) -> Path:
        """Atomic checkpoint: each rank writes its own shards (no gather), rank 0 the marker."""
        mesh, parts, layout = Mesh.of(fsdp=self.world), {}, {}
        for name, (module, oname, opt) in self._modules().items():
            sd = module.state_dict()
            parts[name] = {k: _local(v) for k, v in sd.items()}
            layout.update({f"{name}/{k}": {"shape": list(v.shape),
                                           "spec": [list(d) for d in from_placements(v.placements, mesh, v.dim()).dims]}
                           for k, v in sd.items() if hasattr(v, "placements")})
            o = opt.state_dict()
            parts[oname] = {"param_groups": o["param_groups"],
                            "state": {i: {k: _local(v) for k, v in st.items()} for i, st in o["state"].items()}}
        state = {"step": self.step_idx, "version": self.version, "samples_seen": self.samples_seen,
                 "tokens_seen": self.tokens_seen, "optim_steps": self.optim_steps, "task": self.task.state(),
                 "config": self.cfg.to_dict()}
        path = save_checkpoint(self.out / "checkpoints", self.step_idx, parts=parts, state=state, layout=layout,
                               rng=rng_states(), rank=self.rank, world_size=self.world,
                               barrier=dist.barrier if self.world > 1 else (lambda: None), _crash_after=_crash_after)
        if self.rank == 0:
            self._emit("checkpoint", {"step": self.step_idx, "path": str(path)})
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Load the given (or latest complete) checkpoint — this rank's shards into its local
        parameters and optimizer state — and refit the engine before generating."""
        path = Path(path) if path else latest_checkpoint(self.out / "checkpoints")
        if path is None:
            return False
        ck = load_checkpoint(path, world_size=self.world, rank=self.rank)
        for name, (module, oname, opt) in self._modules().items():
            if name not in ck:
                raise CheckpointError(f"{path}: no {name!r} part (this run has one; the checkpoint was written "
                                      f"without it)")
            _load_local(module, ck[name], f"{path}: {name}")
            _load_optimizer(opt, ck[oname])
        set_rng_states(ck["rng"])
        st = ck["state"]
        self.step_idx, self.samples_seen, self.tokens_seen = st["step"], st["samples_seen"], st["tokens_seen"]
        self.optim_steps = st.get("optim_steps", 0)
        self.task.load_state(st.get("task", {}))
        target = st["version"]
        if self.engine.policy_version >= target:  # versions only grow: republish as the next one
            target = self.engine.policy_version + 1
        self.engine.load_weights(self._through_plan(), version=target)  # refit before the first generation
        self.version = target
        return True

    def _mean_over_ranks(self, metrics: dict) -> dict:
        """Numeric metrics averaged over ranks (a key some ranks lack averages over those that have it)."""
        if self.world == 1:
            return metrics
        mine = {k: float(v) for k, v in metrics.items()
                if isinstance(v, int | float) and k not in ("step", "policy_version")}
        names: list = [None] * self.world
        dist.all_gather_object(names, sorted(mine))
        keys = sorted(set().union(*names))
        t = torch.tensor([[mine.get(k, 0.0), float(k in mine)] for k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        return {**metrics, **{k: s / c for k, (s, c) in zip(keys, t.tolist()) if c}}

    def _emit(self, event: str, metrics: dict) -> None:
        for h in self.hooks:
            h(event, self, metrics)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself when not sharded)."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def _load_local(module: torch.nn.Module, tensors: dict, where: str) -> None:
    for k, v in module.state_dict(keep_vars=True).items():
        if k not in tensors:
            raise CheckpointError(f"{where}: tensor {k!r} is missing")
        dst = _local(v)
        if tuple(dst.shape) != tuple(tensors[k].shape):
            raise CheckpointError(f"{where}: {k!r} shard has shape {list(tensors[k].shape)}, this rank holds "
                                  f"{list(dst.shape)}")
        dst.copy_(tensors[k])


def _load_optimizer(opt, sd: dict) -> None:
    """Local optimizer state back onto (possibly DTensor) parameters, then ``load_state_dict``."""
    from torch.distributed.tensor import DTensor

    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, st in sd["state"].items():
        p = params[int(i)]
        state[int(i)] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                         if hasattr(p, "placements") and torch.is_tensor(v) and v.dim() == p.dim() else v
                         for k, v in st.items()}
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def write_jsonl(path: Path):
    """A hook appending every step/eval record to ``path`` as JSON lines."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(event, trainer, metrics):
        if event in ("step", "eval"):
            with path.open("a") as f:
                f.write(json.dumps({"event": event, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                                       for k, v in metrics.items()}}) + "\n")

    return hook

