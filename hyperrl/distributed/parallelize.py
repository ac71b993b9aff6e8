"""Parallelism applied in one place (torchtitan's pattern: one function per family, not in the loop).

:func:`parallelize_models` applies every parallel dimension of a run (``run.ep``, ``run.tp``, ``run.cp``, data
parallelism) to the trainer's models in one fixed order; a new dimension is a branch there plus its size in
:class:`~hyperrl.distributed.dims.ParallelDims` and its rules in the config (docs/trainer.md).

``parallelize_qwen3(model, mesh)`` — a 2-D ``("dp", "tp")`` device mesh: tensor parallelism over
``tp`` for every decoder layer (q/k/v and gate/up column-parallel, o/down row-parallel —
Megatron's split; HF's Qwen3 attention reshapes with ``-1`` heads, so each rank runs its local
heads), then FSDP2 over ``dp`` for each layer and the root. Embeddings, norms and the LM head are
FSDP-sharded over ``dp`` and replicated over ``tp``; the TP-sharded weights become 2-D DTensors
(``_StridedShard`` on dim 0 under FSDP for the column-parallel ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperrl.registry import Registry

__all__ = ["Models", "parallelize_models", "decoder_layers", "parallelize", "parallelize_qwen3", "QWEN3_TP_PLAN",
           "PARALLELIZE_PLANS", "register_parallelize_plan", "TP_PARTIAL_GRADS", "tp_partial_params",
           "fully_shard_model", "tensor_parallel_model", "parallelize_teachers"]

# model_type → the family's TP × FSDP2 function ``fn(model, mesh, *, mp_policy)``; a new family is one
# registered function
PARALLELIZE_PLANS: Registry = Registry("parallelize plan")
register_parallelize_plan = PARALLELIZE_PLANS.register

QWEN3_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}


# Replicated over ``tp`` but applied to each rank's *local* heads (Qwen3's per-head q/k RMSNorm):
# each rank's gradient is a partial sum, which the data-parallel strategy sums over the TP group
# before clipping (Megatron all-reduces these "layernorm grads" across TP the same way).
TP_PARTIAL_GRADS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def tp_partial_params(model: torch.nn.Module) -> list:
    """The parameters whose gradients are partial over the TP group (:data:`TP_PARTIAL_GRADS`)."""
    return [p for n, p in model.named_parameters() if n.endswith(TP_PARTIAL_GRADS)]


@register_parallelize_plan("qwen3")
def parallelize_qwen3(model: torch.nn.Module, mesh, *, mp_policy=None, ignored=None) -> torch.nn.Module:
    """Apply TP over ``mesh["tp"]`` and FSDP2 over ``mesh["dp"]`` in place (see the module doc).
    Head counts must divide by the TP degree (error names them). A mixture's sparse layers (Qwen3-MoE:
    ``mlp.gate`` + ``mlp.experts``) have no ``mlp.gate_proj``: their MLP stays whole over ``tp`` (each
    rank of a TP group sees the group's tokens) — FSDP-sharded over ``dp``, or expert-parallel
    (``ignored``: parameters FSDP leaves alone, :mod:`hyperrl.distributed.expert_parallel`)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg, tp = model.config, mesh["tp"].size()
    dense_mlp = any(hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)
    for what, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size if dense_mlp else 0)):
        if n % tp:
            raise ValueError(f"tensor parallelism tp={tp} must divide the model's {what} ({n})")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    if ignored:
        kw["ignored_params"] = set(ignored)
    for layer in model.model.layers:
        names = {n for n, _ in layer.named_modules()}
        parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in QWEN3_TP_PLAN.items() if k in names})
        fully_shard(layer, mesh=mesh["dp"], **kw)
    fully_shard(model, mesh=mesh["dp"], **kw)
    return model


# Qwen2 (its q/k/v biases shard with their rows), Llama and Mistral share Qwen3's module names and
# head arithmetic, so one plan serves the four families — and Qwen3-MoE, whose sparse layers keep their MLP
# whole over tp (above).
for _family in ("qwen2", "llama", "mistral", "qwen3_moe"):
    PARALLELIZE_PLANS.add(_family, parallelize_qwen3)


def parallelize(model: torch.nn.Module, mesh, *, mp_policy=None, ignored=None) -> torch.nn.Module:
    """TP × FSDP2 by the model family's function (``model.config.model_type``); an unmodelled
    family is an error naming the ones there are. ``ignored``: parameters FSDP leaves alone."""
    kind = getattr(model.config, "model_type", None)
    if kind not in PARALLELIZE_PLANS:
        raise ValueError(f"run.tp > 1: no tensor-parallel plan for model_type {kind!r} (have: "
                         f"{', '.join(PARALLELIZE_PLANS.names())}); use run.tp=1 (FSDP2 over every rank)")
    kw = {"ignored": ignored} if ignored else {}
    return PARALLELIZE_PLANS.get(kind)(model, mesh, mp_policy=mp_policy, **kw)


def fully_shard_model(module, layers, dims, device: torch.device, dtype: torch.dtype, ignored=None):
    """FSDP2 over all ranks on a device mesh of the run's device type (gloo on CPU, NCCL/HCCL on
    devices): each decoder layer, then the root. Mixed precision by FSDP2's
    ``MixedPrecisionPolicy``: parameters all-gathered and computed in ``dtype``, gradients
    reduced in fp32 (the sharded master weights and the optimizer state stay in
    ``model.param_dtype``). FSDP averages gradients over ranks; the trainer scales each loss by the
    world size so the result is the *sum* the global token normaliser expects (gloo has no
    PREMUL_SUM for a divide factor of 1), keeping accumulation exact. ``ignored``: parameters FSDP
    leaves alone (expert-parallel experts, :mod:`hyperrl.distributed.expert_parallel`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = dims.mesh(device.type)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    kw = {"ignored_params": set(ignored)} if ignored else {}  # expert-parallel experts: sharded their own way
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **kw)
    fully_shard(module, mesh=mesh, mp_policy=mp, **kw)
    return module


def tensor_parallel_model(module, dims, device: torch.device, dtype: torch.dtype, ignored=None):
    """TP over groups of ``dims.tp`` consecutive ranks and FSDP2 over the ``dims.dp`` data-parallel
    groups, on the run's ``(dp, tp)`` device mesh — the model family's plan (:data:`PARALLELIZE_PLANS`),
    mixed precision as in :func:`fully_shard_model`; ``ignored`` as there."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return parallelize(module, dims.mesh(device.type), mp_policy=mp, ignored=ignored)


@dataclass(frozen=True)
class Models:
    """The trainer's models: the ``policy``, a frozen ``reference`` (KL, preference; or None) and a ``critic``
    (or None)."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None


def decoder_layers(model: torch.nn.Module):
    """The model's decoder layers (FSDP2's units): ``model.layers``, a vision-language model's
    ``model.language_model.layers`` (its vision tower stays in the root unit)."""
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def parallelize_models(models: Models, dims, parallel, *, device: torch.device, dtype: torch.dtype,
                       lora: bool = False) -> Models:
    """Every parallel dimension applied to the trainer's models, in one fixed order — the one place parallelism is
    applied (torchtitan's ``parallelize_llama``):

    * ``cp > 1`` first: Ulysses or ring attention over ``cp`` (``dims.cp_attention``) for the policy, a reference
      and a critic (:mod:`hyperrl.distributed.context_parallel`), on the plain modules;
    * ``ep > 1``: each sparse layer's experts split over groups of ``ep`` ranks
      (:mod:`hyperrl.distributed.expert_parallel`; with ``cp``, an ``ep`` group pools its ranks' slices' tokens),
      then the rest tensor-parallel by the family's plan
      (``tp > 1``) or FSDP2-sharded, the experts' gradients summed over their replicas by the strategy;
    * else ``tp > 1``: TP × FSDP2 by the family's plan (:data:`PARALLELIZE_PLANS`), the partial-gradient
      parameters summed over the TP group;
    * else data parallel: FSDP2 over every rank (a LoRA policy: the frozen base replicated, its adapters' gradients
      all-reduced) and the critic FSDP2-sharded.

    A reference stays a whole frozen copy on every rank. ``parallel``: the data-parallel strategy, told which
    gradients to reduce; checks that need the built models ran before
    (:func:`hyperrl.config.built.check_built`). Returns the models (the policy and critic wrapped)."""
    policy, critic = models.policy, models.critic
    if dims.cp > 1 and dims.world > 1:  # before sharding: the plain modules' attention is swapped
        from hyperrl.distributed.context_parallel import context_parallel

        for model in (policy, models.reference, None if critic is None else critic.backbone):
            if model is not None:
                context_parallel(model, parallel.cp_group, dims.cp_attention)
    if dims.ep > 1:
        policy = _expert_parallel(policy, dims, parallel, device, dtype)
    elif dims.tp > 1:
        policy = tensor_parallel_model(policy, dims, device, dtype)
        parallel.sum_over_tp(tp_partial_params(policy))
    elif dims.world > 1:
        if not lora:
            policy = fully_shard_model(policy, decoder_layers(policy), dims, device, dtype)
        else:  # the frozen base replicated, the adapters' gradients all-reduced (parallel.sync_grads)
            parallel.replicate(policy)
        if critic is not None:
            critic = fully_shard_model(critic, critic.backbone.layers, dims, device, dtype)
    return replace(models, policy=policy, critic=critic)


def parallelize_teachers(teachers: dict, dims, parallel) -> dict:
    """Distillation teachers (no-grad, whole frozen copies on every rank) under ``cp > 1``: the policy's cp
    attention swapped in, so each rank runs its slice of every sequence as the policy does (their log-probs gathered
    the same way). Checked first (:func:`hyperrl.config.built.check_teachers`)."""
    if dims.cp > 1 and dims.world > 1:
        from hyperrl.distributed.context_parallel import context_parallel

        for teacher in teachers.values():
            context_parallel(teacher, parallel.cp_group, dims.cp_attention)
    return teachers


def _expert_parallel(policy, dims, parallel, device, dtype):
    """``ep > 1``: the experts DTensors on the ``("replica", "ep")`` mesh (tokens dispatched by all-to-all; with
    ``tp > 1`` an ``ep`` group is ``ep`` data-parallel ranks at one TP coordinate), the rest TP × FSDP2 or FSDP2."""
    from hyperrl.distributed.expert_parallel import expert_params, shard_experts

    mesh = dims.expert_mesh(device.type)
    experts = shard_experts(policy, mesh.get_group("ep"), mesh.get_local_rank("ep"), dims.ep, mesh)
    params = expert_params(experts)
    if dims.tp > 1:
        policy = tensor_parallel_model(policy, dims, device, dtype, ignored=params)
        parallel.sum_over_tp(tp_partial_params(policy))
    else:
        policy = fully_shard_model(policy, policy.model.layers, dims, device, dtype, ignored=params)
    parallel.experts_over(params, mesh.get_group("replica"))
    return policy
