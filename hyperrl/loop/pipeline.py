"""The pre-update chain, the key providers and the loss terms of a resolved ``algo`` section, as bound components
(:class:`Pipeline`), which the loop calls and a user may replace or extend in Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hyperrl import transforms as T
from hyperrl.algorithms import KEY_PROVIDERS, LOSS_TERMS, Term, term

__all__ = ["Pipeline", "build_pipeline"]


@dataclass(frozen=True)
class Pipeline:
    """The pre-update chain and the loss pieces of a resolved ``algo`` section, as bound components.

    ``shape``: batch → batch (reward shaping, in order); ``filter``: batch → (batch, dropped) or
    None (the loop refills); ``transform``: batch → batch with ``advantages`` (and ``returns``);
    ``objective`` / ``correction``: bound callables for :func:`hyperrl.transforms.policy_loss`;
    ``proximal``: A-3PO's interpolated π_prox (:func:`hyperrl.transforms.interpolated_proximal_logprobs`) or
    None (a proximal forward); ``terms``: the loss terms whose sum is the loss (:mod:`hyperrl.algorithms.terms`);
    ``needs``: every batch key the components and terms read — the key providers of those that have one run
    before the advantages (:mod:`hyperrl.algorithms.keys`), with ``provider_args`` (key → hyperparameters, from
    the component that needs it); ``shaped``: reward shaping is configured.
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
    terms: tuple[Term, ...] = ()
    proximal: Callable | None = None
    provider_args: dict = field(default_factory=dict)

    def loss_kwargs(self, beta: float) -> dict:
        """Keyword arguments of ``policy_loss`` (β from the KL controller's state)."""
        return dict(objective=self.objective, agg=self.agg, entropy_coef=self.entropy_coef, kl_coef=beta,
                    kl_estimator=self.kl_estimator, kl_clamp_input=self.kl_clamp_input,
                    kl_clamp_output=self.kl_clamp_output)

    def with_terms(self, *terms: Term) -> Pipeline:
        """This pipeline with ``terms`` added after its own (and the keys they need)."""
        return replace(self, terms=(*self.terms, *terms), needs=self.needs | {n for t in terms for n in t.needs})


def _provider_args(components) -> dict[str, dict]:
    """Key → the hyperparameters its provider takes from the component that needs the key (M2PO's ``tau``)."""
    out: dict[str, dict] = {}
    for f, args in components:
        for key in f.needs:
            if key in KEY_PROVIDERS:
                params = KEY_PROVIDERS.factory(key).params
                out.setdefault(key, {}).update({k: v for k, v in args.items() if k in params})
    return out


def _terms(algo, needs) -> tuple[Term, ...]:
    """The loss terms ``algo`` lists: a preference loss alone, or the policy terms, full-vocabulary distillation,
    the critic's value loss (when a component needs ``values``) and ``algo.loss_terms``, in that order."""
    if algo.preference is not None:
        spec = algo.preference
        return (term("preference", loss=T.PREFERENCE_LOSSES.build(spec.name, **spec.args),
                     beta=float(spec.args["beta"])),)
    out = [term("policy")]
    d = algo.distill
    if d is not None and d.full_vocab:  # on-policy GKD: the whole next-token distribution toward the teacher's
        out.append(term("distill_full_vocab", coef=d.coef, jsd_beta=d.jsd_beta))
    if "values" in needs:
        out.append(term("critic", value_clip=algo.critic.value_clip, value_coef=algo.critic.value_coef))
    out += [term(t.name, **t.args) for t in algo.loss_terms]
    return tuple(out)


def build_pipeline(algo) -> Pipeline:
    """Bind every component of a resolved ``algo`` section (see :func:`resolve`)."""
    shaping = [T.SHAPING.factory(s.name) for s in algo.shaping]
    adv = T.ADVANTAGES.factory(algo.advantage.name)
    obj = T.OBJECTIVES.factory(algo.objective.name)
    corr = T.CORRECTIONS.factory(algo.correction.name) if algo.correction else None
    filt = T.FILTERS.factory(algo.filter.name) if algo.filter else None
    components = [(adv, algo.advantage.args), (obj, algo.objective.args)]
    components += [(corr, algo.correction.args)] if corr else []
    components += [(filt, algo.filter.args)] if filt else []
    components += [(f, s.args) for f, s in zip(shaping, algo.shaping)]
    components += [(LOSS_TERMS.factory(t.name), t.args) for t in algo.loss_terms]
    needs = {n for f, _ in components for n in f.needs}
    if algo.kl.coef > 0:
        needs.add("ref_logprobs")
    adv_fn = T.bind(T.compute_advantages, estimator=adv.build(**algo.advantage.args))
    stages = [adv_fn]
    d = algo.distill
    if d is not None and d.full_vocab:  # the teacher's whole distribution enters the loss (a loss term)
        stages.append(T.bind(T.scale_advantages, coef=d.task_coef))
    elif d is not None:  # on-policy distillation: the teacher's log-probs of the student's tokens
        needs |= {"teacher_logprobs"}
        stages.append(T.bind(T.add_distill_advantages, coef=d.coef, task_coef=d.task_coef, clip=d.clip,
                             whiten=d.whiten))
    terms = _terms(algo, needs)
    if algo.preference is not None:  # pairs, not rollouts: no advantages; the preference term needs the reference
        stages, needs = [], set()
    needs |= {n for t in terms for n in t.needs}
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
        entropy_coef=algo.entropy_coef, needs=frozenset(needs), shaped=bool(algo.shaping), terms=terms,
        proximal=T.interpolated_proximal_logprobs if algo.proximal == "interpolate" else None,
        provider_args=_provider_args(components))
