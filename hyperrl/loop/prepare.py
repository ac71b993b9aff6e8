"""Preparing a batch for the update: the trainer's forwards (log-probs, values) and the keys the
pipeline needs before its advantages, each from its registered key provider
(:mod:`hyperrl.algorithms.keys`: critic values, a greedy baseline, behaviour and reference log-probs
with the bit-exact gate, …).

:class:`Forwards` runs every trainer forward under mixed precision (``model.dtype`` over
``model.param_dtype``): log-probs and entropy by the shared-prefix, packed or plain forward
(:mod:`hyperrl.loop.forward`), the critic's values, and no-grad passes micro-batched by
``optim.micro_batch_tokens``. :class:`Preparer` runs the providers and the update's policy forward.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from tensordict import TensorDict

from hyperrl.algorithms import GateError, PolicyOut, PrepareContext, Provided, providers
from hyperrl.device import compute_context, torch_dtype
from hyperrl.loop.forward import (
    context_parallel_logprobs_and_entropy,
    context_parallel_values,
    full_vocab_divergence,
    packed_logprobs_and_entropy,
    plain_log_softmax,
    plain_sum_pi_squared,
    policy_logprobs,
)
from hyperrl.loop.learner import map_micro_batches
from hyperrl.loop.model_calls import RouteReplay
from hyperrl.models.head import use_fused_head
from hyperrl.models.moe import RouterTap, Routing, is_moe
from hyperrl.multimodal import vision_spec
from hyperrl.routing import RoutePlan
from hyperrl.trajectory import validate

__all__ = ["Forwards", "Preparer", "GateError"]


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
        fused = use_fused_head(self.cfg.optim.fused_head, model)  # no [B, T, V] logits
        with self.amp():
            if self.parallel.cp > 1:  # each rank a slice of every sequence (a mixture's routes sliced with it)
                out = context_parallel_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                            self.parallel.cp_group, replay=replay,
                                                            packed=bool(self.cfg.optim.pack_tokens), fused=fused)
            elif self.cfg.optim.pack_tokens:
                out = packed_logprobs_and_entropy(model, batch, self.cfg.rollout.temperature,
                                                  self.cfg.optim.pack_tokens, replay, fused=fused,
                                                  agree=self.parallel.agree_calls())
            else:
                out = policy_logprobs(model, batch, self.cfg.rollout.temperature, shared_prefix=shared,
                                      agree=self.parallel.agree_forward(), replay=replay, fused=fused)
        return out if replay is None else (*out, replay.captured.to(out[0].device))

    def log_softmax(self, model, batch: TensorDict) -> tuple[int, torch.Tensor]:
        """``(a, log π(·|s) [B, T − a, V])`` of ``model`` from the batch's first action position (fp32)."""
        with self.amp():
            return plain_log_softmax(model, batch, self.cfg.rollout.temperature)

    def full_vocab_divergence(self, student, teacher, batch: TensorDict, divergence) -> tuple[int, torch.Tensor]:
        """``(a, divergence(log π_s, log π_t) [B, T − a])`` over the whole vocabulary from the batch's first action
        position (:func:`hyperrl.loop.forward.full_vocab_divergence`) — with the fused head when both models
        take it (``optim.fused_head``), chunk by chunk."""
        mode = self.cfg.optim.fused_head
        fused = use_fused_head(mode, student) and use_fused_head(mode, teacher)
        with self.amp():
            return full_vocab_divergence(student, teacher, batch, self.cfg.rollout.temperature, divergence,
                                         fused=fused)

    def sum_pi_squared(self, model, batch: TensorDict) -> torch.Tensor:
        """``Σ_v π_v²`` of ``model``'s distribution at every token ``[B, T]`` (at the sampling temperature)."""
        with self.amp():
            return plain_sum_pi_squared(model, batch, self.cfg.rollout.temperature)

    def values(self, critic, batch: TensorDict) -> torch.Tensor:
        """The critic's token-aligned values ``[B, T]`` in fp32 (under ``run.cp``: each rank a slice of every
        sequence)."""
        with self.amp():
            if self.parallel.cp > 1:
                return context_parallel_values(critic, batch, self.parallel.cp_group).float()
            return critic(batch).float()

    def no_grad(self, fn, batch: TensorDict):
        """``fn(batch)`` without autograd, micro-batched by ``optim.micro_batch_tokens`` (peak memory
        bounded by the micro-batch, not the rollout batch); the whole batch at once when it is 0."""
        if not self.cfg.optim.micro_batch_tokens:
            return fn(batch)
        return map_micro_batches(fn, batch, self.cfg.optim.micro_batch_tokens, self.parallel)


class Preparer:
    """Runs the key providers of what the pipeline needs (:meth:`prepare`) and the update's policy forward
    (:meth:`policy_forward`); holds the run's :class:`~hyperrl.routing.RoutePlan` for a mixture of experts and
    whether the update is a single pass (:attr:`single_pass`)."""

    def __init__(self, forwards: Forwards, policy, pipeline, cfg, *, reference=None, critic=None, teachers=None,
                 generator=None, scorer=None):
        self.forwards, self.policy, self.pipeline = forwards, policy, pipeline
        self.reference, self.critic = reference, critic
        self.generator, self.scorer = generator, scorer  # a rollout-based key (ReMax's greedy baseline)
        self.teachers = dict(teachers or {})  # on-policy distillation: data_source (None: every row) → model
        if "teacher_logprobs" in pipeline.needs and not self.teachers:
            raise ValueError("the pipeline needs teacher_logprobs but no teacher was built (algo.distill)")
        self.vision = vision_spec(policy)  # a vision-language policy: its placeholder id and merge
        a = cfg.algo
        self.gate_threshold = a.gate_threshold
        # one on-policy pass with no gate, reference or correction: the rollout's own log-probs serve as the
        # behaviour policy (the trainer's forward would recompute the same values up to float rounding), and the
        # mismatch metrics come from the update's forward — one forward saved. R2 needs the old pass (its routes
        # are what the update replays).
        single = a.ppo_epochs == 1 and cfg.optim.mini_batches == 1 and a.gate_threshold is None and \
            reference is None and pipeline.correction is None
        self.routes = None
        if is_moe(policy):  # a mixture of experts: its routers' replay / capture / agreement hooks (docs/moe.md)
            ref = Routing(reference) if reference is not None and is_moe(reference) else None
            self.routes = RoutePlan(Routing(policy), ref, a.routing_replay)
            single = single and not self.routes.replays_old
            self.routes = replace(self.routes, single_pass=single)
        elif a.routing_replay != "none":
            raise ValueError(f"algo.routing_replay={a.routing_replay}: the policy ({type(policy).__name__}) has no "
                             "MoE router; routing replay needs a mixture of experts — set algo.routing_replay=none")
        self.single_pass = single
        self.providers = providers(pipeline.needs, pipeline.provider_args)

    def context(self, *, step: int = 0, version: int = 0, samples: dict | None = None) -> PrepareContext:
        """What the providers read (:class:`~hyperrl.algorithms.PrepareContext`) at ``step`` / ``version``."""
        return PrepareContext(forwards=self.forwards, policy=self.policy, reference=self.reference,
                              critic=self.critic, teachers=self.teachers, routes=self.routes,
                              single_pass=self.single_pass, proximal=self.pipeline.proximal,
                              gate_threshold=self.gate_threshold, step=step, version=version, samples=samples,
                              generator=self.generator, scorer=self.scorer)

    @torch.no_grad()
    def prepare(self, batch: TensorDict, *, step: int = 0, version: int = 0, samples: dict | None = None
                ) -> tuple[TensorDict, dict]:
        """A new batch with every key the pipeline needs that a provider makes (``samples``: the step's prompts by
        group id, for providers that read them), the batch's routes and image placeholders checked first; returns
        it and the providers' metrics (the gate's mismatch)."""
        if self.routes is not None:  # routes checked at every batch
            self.routes.check(batch)
        if self.vision is not None:  # every row's image placeholders against its grids, before any forward
            validate(batch, image_token_id=self.vision.image_token_id, merge=self.vision.merge)
        ctx = self.context(step=step, version=version, samples=samples)
        out, metrics = batch.copy(), {}
        for provider in self.providers:
            got = provider(ctx, out)
            if isinstance(got, Provided):
                for k, v in got.keys.items():
                    out.set(k, v)
                metrics.update(got.metrics)
            else:
                out.set(provider.name, got)
        return out, metrics

    def policy_forward(self, part: TensorDict) -> PolicyOut:
        """The update's policy forward on a micro-batch (with the graph): log-probs and entropies, and for a mixture
        of experts the routes of :meth:`~hyperrl.routing.RoutePlan.update` and the routers' logits tapped."""
        f = self.forwards
        if self.routes is None:
            lp, ent = f.logprobs(self.policy, part)
            return PolicyOut(lp, ent)
        routes = self.routes.update(part)  # routing replay (R2 / R3) or the agreement measured
        self.routes.routing.reset()
        with RouterTap(self.policy) as tap:
            lp, ent, _ = f.logprobs(self.policy, part, routes)
        if f.parallel.cp > 1:  # each rank tapped its slice's tokens: the load-balancing term needs all
            from hyperrl.distributed.context_parallel import gather_tokens

            return PolicyOut(lp, ent, tap.snapshot(functools.partial(gather_tokens, group=f.parallel.cp_group)))
        return PolicyOut(lp, ent, tap)
