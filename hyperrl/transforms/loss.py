"""TensorDict adapters for losses: ``policy_loss`` and ``critic_loss`` return a :class:`LossOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from hyperrl.transforms.aggregation import Normalizer, aggregate
from hyperrl.transforms.correction import Correction
from hyperrl.transforms.kl import kl_penalty
from hyperrl.transforms.objectives import OBJECTIVES, value_loss

__all__ = ["LossOutput", "policy_loss", "critic_loss"]


@dataclass(frozen=True)
class LossOutput:
    """Typed loss record: ``terms`` are the ``loss_*`` scalars the caller sums (they carry the
    gradient); ``metrics`` are detached diagnostics."""

    terms: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss(self) -> torch.Tensor:
        """``Σ terms`` — the scalar to call ``backward()`` on."""
        return sum(self.terms.values())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.terms[key] if key in self.terms else self.metrics[key]

    def __add__(self, other: LossOutput) -> LossOutput:
        """Both records' terms and metrics (a name in both is an error: nothing is silently replaced)."""
        for a, b, what in ((self.terms, other.terms, "term"), (self.metrics, other.metrics, "metric")):
            both = sorted(set(a) & set(b))
            if both:
                raise ValueError(f"LossOutput +: {what} {both[0]!r} is in both records")
        return LossOutput({**self.terms, **other.terms}, {**self.metrics, **other.metrics})

    def scalars(self) -> dict[str, float]:
        """Every term and metric as Python floats (for logging)."""
        return {k: float(v.detach()) for k, v in {**self.terms, **self.metrics}.items()}


def _require(batch: TensorDict, key: str, hint: str) -> torch.Tensor:
    if key not in batch.keys():
        raise KeyError(f"{key}: missing from the batch; {hint}")
    return batch[key]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.bool()
    return (torch.where(m, x, 0).sum() / m.sum().clamp_min(1)).detach()


def policy_loss(
    batch: TensorDict,
    logprobs: torch.Tensor,
    *,
    objective="ppo_clip",
    agg: str = "token-mean",
    normalizer: Normalizer | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp_input: float | None = None,
    kl_clamp_output: float | None = None,
    correction: Correction | None = None,
    **objective_kwargs,
) -> LossOutput:
    """Policy loss of ``logprobs`` ``[B, T]`` (token-aligned, with gradient) on ``batch``.

    Behaviour log-probs: ``old_logprobs`` if present, else ``rollout_logprobs``. Terms:
    ``loss_policy = agg(objective · w)``, ``loss_kl = β·agg(kl(lp, ref))`` when ``kl_coef > 0``,
    ``loss_entropy = −c·agg(H)`` when ``entropy_coef > 0``. ``correction`` multiplies the
    per-token objective by detached IS weights and drops rejected tokens. ``normalizer`` holds
    the global counts of the optimizer step (see :mod:`~hyperrl.transforms.aggregation`).
    """
    mask = batch["action_mask"]
    if logprobs.shape != mask.shape:
        raise ValueError(f"logprobs: shape {list(logprobs.shape)}, expected {list(mask.shape)} [B, T]")
    old = batch["old_logprobs"] if "old_logprobs" in batch.keys() else batch["rollout_logprobs"]
    adv = _require(batch, "advantages", "run compute_advantages(batch, estimator=...) first")
    if correction is not None:
        mask = mask & correction.mask
    if isinstance(objective, str):  # a name: its own hyperparameters only (sapo takes no clip_low)
        objective_kwargs = OBJECTIVES.factory(objective).check(objective_kwargs, f"objective {objective!r}")
    obj = OBJECTIVES.get(objective)(logprobs, old, adv, mask, **objective_kwargs)
    per_token = obj.loss if correction is None else obj.loss * correction.weights.detach()
    norm = normalizer or Normalizer()
    agg_kw = dict(num_tokens=norm.num_tokens, num_seqs=norm.num_seqs, length_const=norm.length_const)
    terms = {"loss_policy": aggregate(per_token, mask, agg, **agg_kw)}
    d = (logprobs - old).detach()
    metrics = {f"{k}_frac" if k in ("clipped", "dual_clipped") else f"{k}_mean": _masked_mean(v, mask)
               for k, v in obj.metrics.items()}
    metrics["approx_kl"] = _masked_mean(torch.expm1(d) - d, mask)
    if kl_coef > 0:
        ref = _require(batch, "ref_logprobs", "kl_coef > 0 needs reference log-probs [B, T]")
        kl = kl_penalty(logprobs, ref, kl_estimator, clamp_input=kl_clamp_input, clamp_output=kl_clamp_output)
        terms["loss_kl"] = kl_coef * aggregate(kl, mask, agg, **agg_kw)
        metrics["kl"] = _masked_mean(kl, mask)
    if entropy is not None:
        if entropy_coef > 0:
            terms["loss_entropy"] = -entropy_coef * aggregate(entropy, mask, agg, **agg_kw)
        metrics["entropy"] = _masked_mean(entropy, mask)
    return LossOutput(terms, metrics)


def critic_loss(
    batch: TensorDict,
    values: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    normalizer: Normalizer | None = None,
    coef: float = 1.0,
) -> LossOutput:
    """Clipped value loss of ``values`` ``[B, T]`` against ``returns``, old values ``values`` in the batch."""
    returns = _require(batch, "returns", "use an estimator that produces returns (gae, reinforce_pp, remax)")
    old = _require(batch, "values", "store the critic's rollout-time values under 'values'")
    mask = batch["action_mask"]
    obj = value_loss(values, old, returns, mask, clip=clip)
    norm = normalizer or Normalizer()
    loss = aggregate(obj.loss, mask, agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs,
                     length_const=norm.length_const)
    metrics = {"value_clipped_frac": _masked_mean(obj.metrics["clipped"], mask)} if obj.metrics else {}
    return LossOutput({"loss_value": coef * loss}, metrics)
