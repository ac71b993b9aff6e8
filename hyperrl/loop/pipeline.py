"""The pre-update chain and the loss pieces of a resolved ``algo`` section, as bound components
(:class:`Pipeline`), which the loop calls and a user may replace or extend in Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hyperrl import transforms as T

__all__ = ["Pipeline", "build_pipeline"]


@dataclass(frozen=True)
class Pipeline:
    """The pre-update chain and the loss pieces of a resolved ``algo`` section, as bound components.

    ``shape``: batch → batch (reward shaping, in order); ``filter``: batch → (batch, dropped) or
    None (the loop refills); ``transform``: batch → batch with ``advantages`` (and ``returns``);
    ``objective`` / ``correction``: bound callables for :func:`hyperrl.transforms.policy_loss`;
    ``needs``: every batch key the components read; ``shaped``: reward shaping is configured.
    """

    shape: Callable
    filter: Callable | None
    transform: Callable
    objective: Callable
    agg: str
    correction: Callable | None
    kl_coef: float
    kl_estimator: str
    kl_clamp_input: float | None
    kl_clamp_output: float | None
    kl_controller: Callable
    entropy_coef: float
    needs: frozenset
    shaped: bool = False  # reward shaping changes ``reward`` (the raw score is logged beside it)

    def loss_kwargs(self, beta: float) -> dict:
        """Keyword arguments of ``policy_loss`` (β from the KL controller's state)."""
        return dict(objective=self.objective, agg=self.agg, entropy_coef=self.entropy_coef, kl_coef=beta,
                    kl_estimator=self.kl_estimator, kl_clamp_input=self.kl_clamp_input,
                    kl_clamp_output=self.kl_clamp_output)


def build_pipeline(algo) -> Pipeline:
    """Bind every component of a resolved ``algo`` section (see :func:`resolve`)."""
    shaping = [T.SHAPING.factory(s.name) for s in algo.shaping]
    adv = T.ADVANTAGES.factory(algo.advantage.name)
    obj = T.OBJECTIVES.factory(algo.objective.name)
    corr = T.CORRECTIONS.factory(algo.correction.name) if algo.correction else None
    filt = T.FILTERS.factory(algo.filter.name) if algo.filter else None
    needs = set(adv.needs) | set(obj.needs) | set(corr.needs if corr else ()) | set(filt.needs if filt else ())
    needs |= {n for s in shaping for n in s.needs}
    if algo.kl.coef > 0 or algo.preference is not None:  # a preference loss compares with the reference
        needs.add("ref_logprobs")
    adv_fn = T.bind(T.compute_advantages, estimator=adv.build(**algo.advantage.args))
    stages = [adv_fn]
    d = algo.distill
    if d is not None and d.full_vocab:  # the teacher's whole distribution enters the loss (Trainer.loss)
        stages.append(T.bind(T.scale_advantages, coef=d.task_coef))
    elif d is not None:  # on-policy distillation: the teacher's log-probs of the student's tokens
        needs |= {"teacher_logprobs"}
        stages.append(T.bind(T.add_distill_advantages, coef=d.coef, task_coef=d.task_coef, clip=d.clip,
                             whiten=d.whiten))
    return Pipeline(
        shape=T.chain(*[f.build(**s.args) for f, s in zip(shaping, algo.shaping)]),
        filter=filt.build(**algo.filter.args) if filt else None,
        transform=T.chain(*stages),
        objective=obj.build(**algo.objective.args),
        agg=algo.agg.name,
        correction=corr.build(**algo.correction.args) if corr else None,
        kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator, kl_clamp_input=algo.kl.clamp_input,
        kl_clamp_output=algo.kl.clamp_output,
        kl_controller=T.KL_CONTROLLERS.build(algo.kl.controller.name, **algo.kl.controller.args),
        entropy_coef=algo.entropy_coef, needs=frozenset(needs), shaped=bool(algo.shaping))
