"""Preparing a batch for the update: the trainer's forwards (log-probs, values) and what the
pipeline needs before its advantages — critic values, a greedy baseline, behaviour and reference
log-probs — with the bit-exact gate.

:class:`Forwards` runs every trainer forward under mixed precision (``model.dtype`` over
``model.param_dtype``): log-probs and entropy by the shared-prefix, packed or plain forward
(:mod:`hyperrl.loop.forward`), the critic's values, and no-grad passes micro-batched by
``optim.micro_batch_tokens``. :class:`Preparer` adds the keys the pipeline reads.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.device import compute_context, torch_dtype
from hyperrl.loop.forward import (
    RouteReplay,
    context_parallel_logprobs_and_entropy,
    packed_logprobs_and_entropy,
    plain_log_softmax,
    plain_sum_pi_squared,
    policy_logprobs,
)
from hyperrl.loop.learner import map_micro_batches
from hyperrl.models.moe import Routing, check_routes, is_moe
from hyperrl.multimodal import vision_spec
from hyperrl.trajectory import validate

__all__ = ["Forwards", "Preparer", "GateError"]


class GateError(RuntimeError):
    """The bit-exact gate refused an update: trainer and rollout log-probs disagree."""


@contextmanager
def _eval_mode(module: torch.nn.Module):
    """``module.eval()`` inside, its previous mode restored after."""
    was = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was)


class Forwards:
    """The trainer's forwards on ``device`` (``cfg``: the resolved config; ``parallel``: the
    data-parallel strategy, which keeps the ranks' forward paths and micro-batch counts in step)."""

    def __init__(self, cfg, parallel, device: torch.device):
        self.cfg, self.parallel, self.device = cfg, parallel, device
        self._dtypes = (torch_dtype(cfg.model.dtype), torch_dtype(cfg.model.param_dtype))

    def amp(self):
        """Mixed precision of every trainer forward (``model.dtype`` over ``model.param_dtype``)."""
        return compute_context(self.device, *self._dtypes)

    def logprobs(self, model, batch: TensorDict, routes: tuple | None = None):
        """Token log-probs and entropies ``[B, T]`` of ``model`` on ``batch`` (at the sampling temperature).
        ``routes = (routing, key, force)``: a mixture of experts' routing (:class:`RouteReplay` with
        ``batch[key]`` as the reference, ``None`` = capture only) — then the routes the forward used
        ``[B, T, L, k]`` are returned third."""
        # gradient checkpointing drops the KV cache inside checkpointed layers: plain forward then
        shared = self.cfg.optim.shared_prefix and not self.cfg.model.gradient_checkpointing
        replay = None
        if routes is not None:
            routing, key, force = routes
            replay = RouteReplay(routing, batch, batch[key] if key is not None else None, force)
        with self.amp():
            if self.parallel.cp > 1:  # each rank a slice of every sequence (routes refused at load)
                out = context_parallel_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                            self.parallel.cp_group,
                                                            packed=bool(self.cfg.optim.pack_tokens))
            elif self.cfg.optim.pack_tokens:
                out = packed_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                  self.cfg.optim.pack_tokens, replay)
            else:
                out = policy_logprobs(model, batch, self.cfg.rollout.temperature, shared_prefix=shared,
                                      agree=self.parallel.agree_forward(), replay=replay)
        return out if replay is None else (*out, replay.captured.to(out[0].device))

    def log_softmax(self, model, batch: TensorDict) -> tuple[int, torch.Tensor]:
        """``(a, log π(·|s) [B, T − a, V])`` of ``model`` from the batch's first action position (fp32)."""
        with self.amp():
            return plain_log_softmax(model, batch, self.cfg.rollout.temperature)

    def sum_pi_squared(self, model, batch: TensorDict) -> torch.Tensor:
        """``Σ_v π_v²`` of ``model``'s distribution at every token ``[B, T]`` (at the sampling temperature)."""
        with self.amp():
            return plain_sum_pi_squared(model, batch, self.cfg.rollout.temperature)

    def values(self, critic, batch: TensorDict) -> torch.Tensor:
        """The critic's token-aligned values ``[B, T]`` in fp32."""
        with self.amp():
            return critic(batch).float()

    def no_grad(self, fn, batch: TensorDict):
        """``fn(batch)`` without autograd, micro-batched by ``optim.micro_batch_tokens`` (peak memory
        bounded by the micro-batch, not the rollout batch); the whole batch at once when it is 0."""
        if not self.cfg.optim.micro_batch_tokens:
            return fn(batch)
        return map_micro_batches(fn, batch, self.cfg.optim.micro_batch_tokens, self.parallel)


class Preparer:
    """Adds what the pipeline needs before its advantages (see :meth:`prepare`)."""

    def __init__(self, forwards: Forwards, policy, pipeline, cfg, *, reference=None, critic=None, teachers=None):
        self.forwards, self.policy, self.pipeline, self.cfg = forwards, policy, pipeline, cfg
        self.reference, self.critic = reference, critic
        self.teachers = dict(teachers or {})  # on-policy distillation: data_source (None: every row) → model
        if "teacher_logprobs" in pipeline.needs and not self.teachers:
            raise ValueError("the pipeline needs teacher_logprobs but no teacher was built (algo.distill)")
        # a mixture of experts: its routers' replay / capture / agreement hooks (docs/moe.md)
        self.routing = Routing(policy) if is_moe(policy) else None
        self.vision = vision_spec(policy)  # a vision-language policy: its placeholder id and merge
        self._ref_routing = Routing(reference) if reference is not None and is_moe(reference) else None
        if cfg.algo.routing_replay != "none" and self.routing is None:
            raise ValueError(f"algo.routing_replay={cfg.algo.routing_replay}: the policy "
                             f"({type(policy).__name__}) has no MoE router; routing replay needs a mixture of "
                             "experts — set algo.routing_replay=none")

    @property
    def single_pass(self) -> bool:
        """One on-policy pass with no gate, reference or correction: the rollout's own log-probs
        serve as the behaviour policy (the trainer's forward would recompute the same values up to
        float rounding), and the mismatch metrics come from the update's forward — one forward saved.
        R2 needs the old pass (its routes are what the update replays)."""
        a = self.cfg.algo
        return a.ppo_epochs == 1 and self.cfg.optim.mini_batches == 1 and a.gate_threshold is None and \
            self.reference is None and self.pipeline.correction is None and a.routing_replay != "r2"

    def route_key(self, batch: TensorDict) -> str | None:
        """The rollout's routes to compare with (and under R3 replay), checked against the policy
        (:func:`hyperrl.models.moe.check_routes`); ``None`` for a dense policy or a batch without
        them when nothing is replayed."""
        mode = self.cfg.algo.routing_replay
        if self.routing is None or (mode == "none" and "routed_experts" not in batch.keys()):
            return None
        check_routes(batch, self.routing, why=f" (algo.routing_replay={mode})" if mode != "none" else "")
        return "routed_experts"

    def update_routes(self, batch: TensorDict) -> tuple | None:
        """The update forward's ``routes`` argument of :meth:`Forwards.logprobs`: R3 replays the
        rollout's, R2 the old pass's; otherwise the rollout's are compared with (single pass only:
        the old pass measured them already)."""
        mode = self.cfg.algo.routing_replay
        if self.routing is None:
            return None
        if mode == "r3":
            return self.routing, "routed_experts", True
        if mode == "r2":
            return self.routing, "old_routed_experts", True
        key = "routed_experts" if self.single_pass and "routed_experts" in batch.keys() else None
        return self.routing, key, False

    def teacher_logprobs(self, batch: TensorDict, sources=None) -> torch.Tensor:
        """The teachers' log-probs of the batch's tokens ``[B, T]`` (micro-batched like the reference's):
        one teacher for every row, or — multi-teacher — each row's ``data_source``'s (``sources(batch)``:
        one per row)."""
        f = self.forwards
        if None in self.teachers:
            return f.no_grad(lambda rows: f.logprobs(self.teachers[None], rows), batch)[0]
        src = list(sources(batch)) if sources is not None else [None] * batch.batch_size[0]
        missing = sorted({str(s) for s in src if s not in self.teachers})
        if missing:
            raise ValueError(f"algo.distill.teachers: no teacher for data_source {', '.join(missing)} (configured: "
                             f"{', '.join(sorted(self.teachers))}); add one, or a single algo.distill.teacher")
        out = torch.zeros(batch["tokens"].shape, dtype=torch.float32, device=batch["tokens"].device)
        # every configured teacher in one order on every rank, even one with no rows here: the micro-batching
        # agrees its call count over ranks (a collective), so each rank must make the same sequence of calls
        for name in sorted(self.teachers):
            idx = torch.tensor([i for i, s in enumerate(src) if s == name], dtype=torch.long, device=out.device)
            lp = f.no_grad(lambda rows, t=self.teachers[name]: f.logprobs(t, rows), batch[idx] if len(idx) else
                           batch[:1])[0]
            if len(idx):
                out[idx] = lp
        return out

    @torch.no_grad()
    def prepare(self, batch: TensorDict, *, step: int, version: int, baseline=None, sources=None
                ) -> tuple[TensorDict, dict]:
        """A new batch with critic ``values``, the greedy ``baseline_reward`` (``baseline(batch)``),
        the teachers' ``teacher_logprobs`` (``sources(batch)``: each row's data_source), behaviour
        ``old_logprobs`` (checked by the gate: :class:`GateError`) and ``ref_logprobs``, as the pipeline
        needs; returns it and the mismatch metrics."""
        f, out, needs = self.forwards, batch.copy(), self.pipeline.needs
        mode, key = self.cfg.algo.routing_replay, self.route_key(batch)  # routes checked at every batch
        if self.vision is not None:  # every row's image placeholders against its grids, before any forward
            validate(batch, image_token_id=self.vision.image_token_id, merge=self.vision.merge)
        if self.critic is not None:
            out.set("values", f.no_grad(lambda rows: f.values(self.critic, rows), batch))
        if "baseline_reward" in needs:
            out.set("baseline_reward", baseline(batch))
        if "teacher_logprobs" in needs:
            out.set("teacher_logprobs", self.teacher_logprobs(batch, sources))
        if "sum_pi_squared" in needs:  # the optimal token baseline: the old policy's Σπ² (verl: the old forward's)
            with _eval_mode(self.policy):
                out.set("sum_pi_squared", f.no_grad(lambda rows: f.sum_pi_squared(self.policy, rows), batch))
        if self.single_pass or self.cfg.algo.proximal == "interpolate":  # (A-3PO: old_logprobs set in the loss)
            return out.set("old_logprobs", batch["rollout_logprobs"]), {}
        routes = None if self.routing is None else (self.routing, key, mode == "r3")
        with _eval_mode(self.policy):  # no dropout (LoRA's) in the behaviour / reference log-probs
            if routes is None:
                lp, _ = f.no_grad(lambda rows: f.logprobs(self.policy, rows), batch)
            else:
                self.routing.reset()
                lp, _, used = f.no_grad(lambda rows: f.logprobs(self.policy, rows, routes), batch)
                if mode == "r2":
                    out.set("old_routed_experts", used.cpu().to(torch.int16).to(lp.device))
        mm = T.mismatch_metrics(lp, batch["rollout_logprobs"], batch["action_mask"])
        if routes is not None:
            mm = {**mm, **self.routing.metrics()}
        thr = self.cfg.algo.gate_threshold
        if thr is not None and float(mm["mismatch_max_abs"]) > thr:
            raise GateError(f"step {step}: trainer vs rollout log-prob gap {float(mm['mismatch_max_abs']):.3e}"
                            f" > gate {thr:.3e} (mean {float(mm['mismatch_mean_abs']):.3e}); update and publish "
                            f"refused, still serving version {version}")
        out.set("old_logprobs", lp)
        if "m2po_keep" in needs:  # M2PO's second moment over the whole step, every data-parallel rank's tokens
            tau = float(self.cfg.algo.correction.args["tau"])
            out.set("m2po_keep", T.m2po_global_mask(batch["rollout_logprobs"] - lp, batch["action_mask"], tau=tau,
                                                    gather=f.parallel.gather_values))
        if self.reference is not None:
            ref = (self._ref_routing, key, True) if mode == "r3" and self._ref_routing is not None else None
            with _eval_mode(self.policy):
                out.set("ref_logprobs", f.no_grad(lambda rows: f.logprobs(self.reference, rows, ref), batch)[0])
        return out, {k: float(v) for k, v in mm.items()}
