"""What vLLM 0.32's own many-to-many resharder (``nccl_m2n``) delivers to each inference rank, from the
same model numbers the planner reads — to compare with hyperrl's plan, in bytes, without hardware.

vLLM's rule (``vllm/distributed/weight_transfer/m2n_layout.py``, ``resolve_parameter_destinations`` and
``_base_loader_shard_dim``): a checkpoint tensor is resharded **directly** — each rank receiving only its
shard — when its name is a live vLLM parameter whose loader is a plain column-parallel, row-parallel or
replicated one; **anything else takes the fallback: the whole tensor delivered to every rank**, which
``load_weights`` then slices. Fused parameters take the fallback because the checkpoint name names no vLLM
parameter: ``q_proj`` / ``k_proj`` / ``v_proj`` → ``qkv_proj``, ``gate_proj`` / ``up_proj`` →
``gate_up_proj``, DeepSeek's ``q_a_proj`` / ``kv_a_proj_with_mqa`` → ``fused_qkv_a_proj``
(``vllm/model_executor/models/deepseek_v2.py``, ``stacked_params_mapping``; ``qwen3.py`` /
``qwen3_moe.py`` ``packed_modules_mapping``), every routed expert → the ``FusedMoE`` ``w13`` / ``w2``; the
vocabulary's ``VocabParallelEmbedding`` / ``ParallelLMHead`` has its own ``weight_loader``
(``vocab_parallel_embedding.py``), which is not one of the accepted loaders; norms have none. What stays
direct and sharded: the row-parallel ``o_proj`` and dense / shared ``down_proj`` (dim 1), DeepSeek's
column-parallel ``q_b_proj`` and ``kv_b_proj`` (dim 0). Replicated tensors (router, norms) reach every
rank whole either way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hyperrl.sharding.models import ModelShape, hf_tensor_shapes

__all__ = ["M2NBytes", "m2n_rule", "m2n_received_bytes"]

# a Qwen2.5-VL tower's attn.proj / projector mlp.2 (row) and projector mlp.0 (column) are plain loaders too;
# its attn.qkv is a QKVParallelLinear (the fallback) and its gate / up fuse into gate_up_proj
_ROW = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.shared_experts.down_proj.weight",
        "mlp.shared_expert.down_proj.weight", "attn.proj.weight", "merger.mlp.2.weight")
_COLUMN = ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "merger.mlp.0.weight")


class M2NBytes(NamedTuple):
    """What vLLM's ``nccl_m2n`` delivers to each inference rank (:func:`m2n_received_bytes`), in bytes:
    ``per_rank = direct + fallback``; ``tensors``: the checkpoint's tensor count."""

    per_rank: int  # bytes every inference rank receives (the rule is the same on every rank)
    direct: int  # of which through direct shards (summed per rank)
    fallback: int  # of which whole tensors (per rank)
    fallback_tensors: int  # how many checkpoint tensors take the fallback
    tensors: int


def m2n_rule(name: str) -> str:
    """``"row"`` / ``"column"`` (direct, sharded on dim 1 / 0) or ``"whole"`` (the fallback, or a replicated
    tensor: every rank receives all of it) for an HF checkpoint tensor name."""
    if ".experts." not in name or ".shared_expert" in name:
        if name.endswith(_ROW):
            return "row"
        if name.endswith(_COLUMN):
            return "column"
    return "whole"


def m2n_received_bytes(cfg: ModelShape, *, tp: int, dtype: torch.dtype = torch.bfloat16) -> M2NBytes:
    """Bytes each inference rank (tensor parallel ``tp``; data-parallel replicas each receive the same)
    receives from vLLM 0.32's ``nccl_m2n`` for ``cfg`` (see the module doc)."""
    item = torch.empty((), dtype=dtype).element_size()
    direct = whole = n_whole = 0
    shapes = hf_tensor_shapes(cfg)
    for name, shape in shapes.items():
        size = math.prod(shape) * item
        rule = m2n_rule(name)
        dim = {"row": 1, "column": 0}.get(rule)
        if dim is not None and shape[dim] % tp == 0:
            direct += size // tp
        else:
            whole += size
            n_whole += 1
    return M2NBytes(direct + whole, direct, whole, n_whole, len(shapes))
