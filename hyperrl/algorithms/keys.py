"""Key providers: the batch keys an algorithm needs before its advantages, each from one registered function.

A key provider is ``fn(ctx, batch, *, hyperparams) -> tensor | Provided``: it reads the prepared batch
(the rollout's keys plus every key provided before it) and a :class:`PrepareContext` (the trainer's
forwards and models, the step's prompts), and returns the key's value ``[B]`` or ``[B, T]`` — or a
:class:`Provided` record when it adds more than one key or reports metrics (the bit-exact gate's).
It registers under the key it provides and declares the keys it reads (``needs``)::

    @KEY_PROVIDERS.register("my_key", needs=("old_logprobs",))
    def my_key(ctx, batch):
        return batch["old_logprobs"].exp()

The preparer (:class:`hyperrl.loop.prepare.Preparer`) runs the providers of every key the pipeline's
components and loss terms need, in :func:`provider_order` (dependencies first, then registration order);
nothing else adds keys before the advantages. A provider's hyperparameters are bound from the arguments of
the configured component that needs its key (M2PO's ``tau`` from ``algo.correction``), so a value lives in one
place. Built in, in run order: ``values`` (the critic), ``baseline_reward`` (ReMax's greedy rollout),
``teacher_logprobs`` (on-policy distillation), ``sum_pi_squared`` (the optimal token baseline),
``old_logprobs`` (the behaviour / proximal policy, with the gate), ``m2po_keep`` (M2PO's step-wide mask),
``ref_logprobs`` (the frozen reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.data import data_source
from hyperrl.errors import HyperRLError
from hyperrl.registry import Registry

__all__ = ["KEY_PROVIDERS", "Provided", "Provider", "PrepareContext", "GateError", "provider_order", "providers",
           "eval_mode"]

KEY_PROVIDERS: Registry = Registry("key provider")


class GateError(HyperRLError, RuntimeError):
    """The bit-exact gate refused an update: trainer and rollout log-probs disagree."""


@dataclass(frozen=True)
class Provided:
    """A provider's output: its keys (``{name: tensor}``, the provider's own key among them) and detached
    metrics (Python floats) the step reports."""

    keys: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PrepareContext:
    """What a key provider may read besides the batch: the trainer's ``forwards``
    (:class:`hyperrl.loop.prepare.Forwards`), its models (``policy``, ``reference``, ``critic``, ``teachers``:
    data_source → model, ``None`` for every row), ``routes`` (a mixture of experts' replay plan,
    :class:`hyperrl.loop.routes.Routes`, or None), ``single_pass`` (the rollout's log-probs serve as the
    behaviour policy's), ``proximal`` (A-3PO's interpolation, or None: a proximal forward), the gate's
    ``gate_threshold``, the ``step`` and served ``version``, the step's prompts (``samples``: group id →
    sample; None where the caller has none), and the ``generator`` / ``scorer`` a rollout-based key uses."""

    forwards: Any
    policy: Any
    reference: Any = None
    critic: Any = None
    teachers: dict = field(default_factory=dict)
    routes: Any = None
    single_pass: bool = False
    proximal: Callable | None = None
    gate_threshold: float | None = None
    step: int = 0
    version: int = 0
    samples: dict | None = None
    generator: Any = None
    scorer: Any = None

    def prompts(self, key: str) -> dict:
        """The step's prompts by group id; a clear error naming ``key`` when the caller passed none."""
        if self.samples is None:
            raise ValueError(f"{key}: the provider reads the step's prompts; pass samples= (Collected.samples) to "
                             "prepare")
        return self.samples


@contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module.eval()`` inside (no dropout: LoRA's), its previous mode restored after."""
    was = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was)


def provider_order(wanted) -> list[str]:
    """The registered providers of the keys in ``wanted`` and of the keys they need, dependencies first, otherwise
    in registration order. A key no provider registers is the rollout's (not listed); a cycle is an error."""
    order: list[str] = []

    def visit(key: str, path: tuple[str, ...]) -> None:
        if key in order or key not in KEY_PROVIDERS:
            return
        if key in path:
            raise ValueError(f"key providers: {' → '.join((*path, key))} is a cycle")
        for need in KEY_PROVIDERS.factory(key).needs:
            visit(need, (*path, key))
        order.append(key)

    for key in KEY_PROVIDERS.in_order():
        if key in wanted:
            visit(key, ())
    return order


@dataclass(frozen=True)
class Provider:
    """A key provider bound to its hyperparameters: ``provider(ctx, batch) -> tensor | Provided``."""

    name: str
    fn: Callable
    needs: tuple[str, ...] = ()

    def __call__(self, ctx: PrepareContext, batch: TensorDict):
        return self.fn(ctx, batch)


def providers(wanted, args: dict[str, dict] | None = None) -> tuple[Provider, ...]:
    """The bound providers of ``wanted`` in :func:`provider_order`, each with its hyperparameters from
    ``args[key]`` (checked against its signature)."""
    args = args or {}
    out = []
    for key in provider_order(wanted):
        f = KEY_PROVIDERS.factory(key)
        out.append(Provider(key, f.build(f"key provider {key!r}", **args.get(key, {})), f.needs))
    return tuple(out)


# ---------------------------------------------------------------------------- the built-in providers, in run order
@KEY_PROVIDERS.register("values")
def values(ctx: PrepareContext, batch: TensorDict) -> torch.Tensor:
    """The critic's token-aligned values ``[B, T]`` (fp32, no grad, micro-batched)."""
    f = ctx.forwards
    return f.no_grad(lambda rows: f.values(ctx.critic, rows), batch)


@KEY_PROVIDERS.register("baseline_reward", needs=("group_id",))
def baseline_reward(ctx: PrepareContext, batch: TensorDict) -> torch.Tensor:
    """ReMax's baseline ``[B]``: the reward of one near-greedy rollout (temperature 1e-5) per group, broadcast to
    the group's rows."""
    prompts = ctx.prompts("baseline_reward")
    groups = torch.unique(batch["group_id"]).tolist()
    samples = [prompts[g] for g in groups]
    gen = ctx.generator
    greedy = ctx.scorer.score(gen.generate(samples, gen.sampling(ctx.step, 10**8, temperature=1e-5), 1),
                              dict(enumerate(samples)))["reward"]
    by_group = dict(zip(groups, greedy.tolist()))
    return torch.tensor([by_group[g] for g in batch["group_id"].tolist()], dtype=torch.float32)


@KEY_PROVIDERS.register("teacher_logprobs")
def teacher_logprobs(ctx: PrepareContext, batch: TensorDict) -> torch.Tensor:
    """The teachers' log-probs of the batch's tokens ``[B, T]`` (micro-batched like the reference's): one teacher
    for every row, or — multi-teacher — each row's ``data_source``'s (its prompt's ``extra``)."""
    f, teachers = ctx.forwards, ctx.teachers  # at least one: the preparer refuses a pipeline that needs them without
    if None in teachers:
        return f.no_grad(lambda rows: f.logprobs(teachers[None], rows), batch)[0]
    prompts = ctx.prompts("teacher_logprobs")
    src = [data_source(prompts[g]) for g in batch["group_id"].tolist()]
    missing = sorted({str(s) for s in src if s not in teachers})
    if missing:
        raise ValueError(f"algo.distill.teachers: no teacher for data_source {', '.join(missing)} (configured: "
                         f"{', '.join(sorted(teachers))}); add one, or a single algo.distill.teacher")
    out = torch.zeros(batch["tokens"].shape, dtype=torch.float32, device=batch["tokens"].device)
    # every configured teacher in one order on every rank, even one with no rows here: the micro-batching
    # agrees its call count over ranks (a collective), so each rank must make the same sequence of calls
    for name in sorted(teachers):
        idx = torch.tensor([i for i, s in enumerate(src) if s == name], dtype=torch.long, device=out.device)
        lp = f.no_grad(lambda rows, t=teachers[name]: f.logprobs(t, rows), batch[idx] if len(idx) else batch[:1])[0]
        if len(idx):
            out[idx] = lp
    return out


@KEY_PROVIDERS.register("sum_pi_squared")
def sum_pi_squared(ctx: PrepareContext, batch: TensorDict) -> torch.Tensor:
    """The old policy's ``Σ_v π_v²`` at every token ``[B, T]`` (the optimal token baseline; verl: the old
    forward's), in eval mode."""
    f = ctx.forwards
    with eval_mode(ctx.policy):
        return f.no_grad(lambda rows: f.sum_pi_squared(ctx.policy, rows), batch)


@KEY_PROVIDERS.register("old_logprobs", needs=("rollout_logprobs",))
def old_logprobs(ctx: PrepareContext, batch: TensorDict) -> torch.Tensor | Provided:
    """The behaviour (proximal) policy's log-probs ``[B, T]``: the rollout's own in a single pass or under A-3PO
    (``ctx.proximal``: the loss interpolates them); else a no-grad forward of the served version, checked by the
    bit-exact gate (:class:`GateError`), with the mismatch metrics — and under R2 the routes it used
    (``old_routed_experts``, which the update replays)."""
    if ctx.single_pass or ctx.proximal is not None:
        return batch["rollout_logprobs"]
    f, policy, routes = ctx.forwards, ctx.policy, ctx.routes
    keys = {}
    with eval_mode(policy):  # no dropout (LoRA's) in the behaviour log-probs
        if routes is None:
            lp, _ = f.no_grad(lambda rows: f.logprobs(policy, rows), batch)
        else:
            routes.routing.reset()
            lp, _, used = f.no_grad(lambda rows: f.logprobs(policy, rows, routes.old(batch)), batch)
            if routes.replays_old:
                keys["old_routed_experts"] = used.cpu().to(torch.int16).to(lp.device)
    mm = T.mismatch_metrics(lp, batch["rollout_logprobs"], batch["action_mask"])
    if routes is not None:
        mm = {**mm, **routes.routing.metrics()}
    thr = ctx.gate_threshold
    if thr is not None and float(mm["mismatch_max_abs"]) > thr:
        raise GateError(f"step {ctx.step}: trainer vs rollout log-prob gap {float(mm['mismatch_max_abs']):.3e}"
                        f" > gate {thr:.3e} (mean {float(mm['mismatch_mean_abs']):.3e}); update and publish "
                        f"refused, still serving version {ctx.version}")
    return Provided({**keys, "old_logprobs": lp}, {k: float(v) for k, v in mm.items()})


@KEY_PROVIDERS.register("m2po_keep", needs=("old_logprobs", "rollout_logprobs"))
def m2po_keep(ctx: PrepareContext, batch: TensorDict, *, tau: float = 0.04) -> torch.Tensor:
    """M2PO's mask ``[B, T]`` over the whole step — every data-parallel rank's tokens: the tokens with the largest
    ``(log π_behav − log π_prox)²`` dropped until the kept second moment is below ``tau``
    (:func:`hyperrl.transforms.m2po_global_mask`)."""
    return T.m2po_global_mask(batch["rollout_logprobs"] - batch["old_logprobs"], batch["action_mask"], tau=tau,
                              gather=ctx.forwards.parallel.gather_values)


@KEY_PROVIDERS.register("ref_logprobs")
def ref_logprobs(ctx: PrepareContext, batch: TensorDict) -> torch.Tensor:
    """The frozen reference's log-probs ``[B, T]`` (no grad, micro-batched, the policy in eval mode); under R3 the
    reference replays the rollout's routes too."""
    f = ctx.forwards
    routes = ctx.routes.reference(batch) if ctx.routes is not None else None
    with eval_mode(ctx.policy):
        return f.no_grad(lambda rows: f.logprobs(ctx.reference, rows, routes), batch)[0]
