"""Loss terms: the pieces whose sum is the trainer's loss, each one registered function.

A loss term is ``fn(ctx, part, out, norm, *, hyperparams) -> LossOutput``: ``part`` is a micro-batch,
``out`` the update's one policy forward on it (:class:`PolicyOut`: token log-probs, entropies, a mixture
of experts' router logits), ``norm`` the step's global normaliser (:class:`hyperrl.transforms.Normalizer`)
and ``ctx`` a :class:`LossContext` (the trainer's forwards and models, the pipeline's bound pieces, the KL
coefficient now, the served version). It returns ``loss_*`` terms (summed by the caller) and detached
metrics. It registers with the batch keys it reads (``needs``: their key providers run before the update,
:mod:`hyperrl.algorithms.keys`)::

    @LOSS_TERMS.register("my_term", needs=("my_key",))
    def my_term(ctx, part, out, norm, *, coef: float = 0.1):
        return LossOutput({"loss_mine": coef * (out.logprobs * part["my_key"]).sum() / norm.num_tokens})

The pipeline lists the run's terms (``algo.loss_terms`` adds registered ones by name, a recipe may set them);
``Trainer.loss`` is their sum over one forward. Built in: ``policy`` (objective, KL, entropy, correction),
``critic`` (PPO's value loss), ``distill_full_vocab`` (on-policy GKD), ``router`` (a mixture of experts'
load balancing) and ``preference`` (DPO and kin, in place of ``policy``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.registry import Registry

__all__ = ["LOSS_TERMS", "BUILT_IN", "Term", "term", "LossContext", "PolicyOut", "pair_logps", "sum_terms"]

LOSS_TERMS: Registry = Registry("loss term")

# the built-in terms the pipeline lists from the config — name → what turns it on (not named in algo.loss_terms)
BUILT_IN = {"policy": "every RL run (algo.objective, algo.kl, algo.entropy_coef, algo.correction)",
            "critic": "an advantage that needs values (algo.advantage=gae; algo.critic)",
            "distill_full_vocab": "algo.distill.full_vocab=true", "router": "a mixture-of-experts policy "
            "(model.experts; model.router_aux_loss_coef)", "preference": "algo.preference"}


@dataclass(frozen=True)
class Term:
    """A loss term bound to its hyperparameters: ``term(ctx, part, out, norm) -> LossOutput``; ``needs``: the batch
    keys it reads (their providers run before the update)."""

    name: str
    fn: Callable
    needs: tuple[str, ...] = ()

    def __call__(self, ctx, part: TensorDict, out, norm) -> T.LossOutput:
        return self.fn(ctx, part, out, norm)


def term(name: str, **hyperparams) -> Term:
    """The registered loss term ``name`` with ``hyperparams`` checked and bound (unknown names and arguments raise,
    naming them)."""
    f = LOSS_TERMS.factory(name)
    return Term(name, f.build(f"loss term {name!r}", **hyperparams), f.needs)


@dataclass(frozen=True)
class PolicyOut:
    """The update's policy forward on a micro-batch: token ``logprobs`` and ``entropy`` ``[b, T]`` (at the sampling
    temperature, with the graph) and, for a mixture of experts, the ``router`` tap
    (:class:`hyperrl.models.moe.RouterTap`: every router's logits of the forward) — else None."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    router: Any = None


@dataclass(frozen=True)
class LossContext:
    """What a loss term may read besides the micro-batch: the trainer's ``forwards`` and models (``policy``,
    ``critic``, ``teachers``), ``pipeline`` (:class:`hyperrl.loop.pipeline.Pipeline`: objective, aggregation,
    correction, A-3PO's ``proximal``), ``kl_beta`` (the KL controller's coefficient now), the served ``version``,
    ``single_pass`` (the update's forward is the only one: it measures the trainer/rollout mismatch) and
    ``routes`` (:class:`hyperrl.routing.RoutePlan` or None)."""

    forwards: Any
    policy: Any
    pipeline: Any
    kl_beta: float = 0.0
    version: int = 0
    single_pass: bool = False
    critic: Any = None
    teachers: dict = field(default_factory=dict)
    routes: Any = None


def sum_terms(outputs) -> T.LossOutput:
    """The loss records of several terms as one (their ``loss_*`` terms and metrics; a name twice is an error)."""
    total = T.LossOutput({})
    for o in outputs:
        total = total + o
    return total


@LOSS_TERMS.register("policy", needs=("old_logprobs",))
def policy(ctx: LossContext, part: TensorDict, out: PolicyOut, norm: T.Normalizer) -> T.LossOutput:
    """The policy terms of :func:`hyperrl.transforms.policy_loss` — objective, KL to the reference, entropy bonus,
    importance correction — with A-3PO's π_prox interpolated from the token versions (``pipeline.proximal``) and,
    in a single pass, the trainer/rollout mismatch metrics from this forward."""
    p, lp = ctx.pipeline, out.logprobs
    if p.proximal is not None:  # A-3PO: π_prox from the token versions, no proximal forward
        part = part.copy().set("old_logprobs", p.proximal(part["rollout_logprobs"], lp, part["token_version"],
                                                          part["action_mask"], ctx.version))
    # a correction may read the current policy's (detached) log-probs: OPSM's mean log-ratio
    corr = p.correction(part.copy().set("logprobs", lp.detach())) if p.correction is not None else None
    res = T.policy_loss(part, lp, normalizer=norm, entropy=out.entropy, correction=corr, **p.loss_kwargs(ctx.kl_beta))
    if ctx.single_pass:
        res = res + T.LossOutput({}, T.mismatch_metrics(lp, part["rollout_logprobs"], part["action_mask"]))
    return res


@LOSS_TERMS.register("distill_full_vocab")
def distill_full_vocab(ctx: LossContext, part: TensorDict, out: PolicyOut, norm: T.Normalizer, *, coef: float = 1.0,
                       jsd_beta: float = 1.0) -> T.LossOutput:
    """On-policy GKD: ``loss_distill = coef · agg(JSD_β(π_s(·|s_t), π_t(·|s_t)))`` over the action tokens (β = 1:
    the reverse KL), the teacher's whole next-token distribution from a no-grad forward of the same micro-batch."""
    a, kl = ctx.forwards.full_vocab_divergence(ctx.policy, ctx.teachers[None], part,
                                               functools.partial(T.full_vocab_jsd, beta=jsd_beta))  # [b, T − a]
    m = part["action_mask"][:, a:]
    loss = coef * T.aggregate(kl, m, ctx.pipeline.agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs,
                              length_const=norm.length_const)
    return T.LossOutput({"loss_distill": loss}, {"distill_kl": kl.detach()[m].mean() if bool(m.any())
                                                 else torch.zeros(())})


@LOSS_TERMS.register("critic", needs=("values", "returns"))
def critic(ctx: LossContext, part: TensorDict, out: PolicyOut, norm: T.Normalizer, *, value_clip: float | None = None,
           value_coef: float = 0.5) -> T.LossOutput:
    """PPO's value loss of the critic's forward on the micro-batch (:func:`hyperrl.transforms.critic_loss`)."""
    values = ctx.forwards.values(ctx.critic, part)
    return T.critic_loss(part, values, clip=value_clip, agg=ctx.pipeline.agg, normalizer=norm, coef=value_coef)


@LOSS_TERMS.register("router")
def router(ctx: LossContext, part: TensorDict, out: PolicyOut, norm: T.Normalizer, *, coef: float = 0.001
           ) -> T.LossOutput:
    """A mixture of experts' load-balancing term from the update's own forward (:func:`hyperrl.transforms.router_loss`)
    — each forward weighted by its share of the step's action tokens (all ranks, micro-batches), so the term sums
    to ``coef`` once per optimizer step (one process over the full batch: exactly the family's loss) — and, in a
    single pass, the routers' agreement with the rollout's routes."""
    tap = out.router
    if tap is None:
        raise ValueError("loss term 'router': the policy forward tapped no router — the policy is dense; drop the "
                         "term")
    share = float(part["action_mask"].sum()) / max(float(norm.num_tokens), 1.0)
    res = T.router_loss(tap.logits, tap.top_k, coef * share, tap.mask)
    if ctx.single_pass:  # else the old pass measured the agreement at the rollout's weights
        agree = ctx.routes.routing.metrics()
        res = res + T.LossOutput({}, {k: torch.tensor(v) for k, v in agree.items()})
    return res


def pair_logps(lp: torch.Tensor, part: TensorDict) -> tuple[torch.Tensor, ...]:
    """Per-pair ``(chosen, rejected, ref_chosen, ref_rejected, chosen_len, rejected_len)`` ``[P]`` of preference
    rows ``[2P, T]``: each row's log-probs ``lp`` (and ``ref_logprobs``) summed over its completion (``action_mask``),
    chosen rows matched to rejected by pair (``group_id``)."""
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


@LOSS_TERMS.register("preference", needs=("ref_logprobs", "chosen"))
def preference(ctx: LossContext, part: TensorDict, out: PolicyOut, norm: T.Normalizer, *, loss: Any,
               beta: float) -> T.LossOutput:
    """A preference loss (``loss``: a bound :data:`hyperrl.transforms.PREFERENCE_LOSSES` factory, ``beta`` its β)
    over the micro-batch's pairs, normalised by the step's pair count (half its sequences: every completion has
    tokens); ``reward_mean`` is ``reward_accuracy`` (what the progress bar and plot read). A one-row part is a
    rank's zero-weight lockstep pass."""
    lp = out.logprobs
    if part.batch_size[0] == 1:
        return T.LossOutput({"loss_dpo": lp.sum() * 0.0})
    res = T.preference_loss(loss, *pair_logps(lp, part), beta=beta, num_pairs=torch.as_tensor(norm.num_seqs) / 2)
    return res + T.LossOutput({}, {"reward_mean": res.metrics["reward_accuracy"]})
