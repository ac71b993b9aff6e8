"""vLLM's side of a layout: its parameter conventions as destination rules.

``rollout_layout(cfg, tp=, dp=, ep=)`` is vLLM's parameters: fused ``qkv_proj`` (kv heads
replicated when ``tp ≥ n_kv`` — :class:`HeadReplicaRule`, vLLM's ``QKVParallelLinear``), fused
``gate_up_proj``, vocab padded to a multiple of 64 then split, row-parallel ``o_proj``/``down_proj``
on dim 1, MLA's fused ``fused_qkv_a_proj``, and ``FusedMoE`` stacked ``w13_weight [E, 2I, H]`` /
``w2_weight [E, H, I]`` — experts TP-sharded on every DP replica, or with ``ep = dp·tp`` spread
over all ranks (``linear`` or ``round_robin``). A Qwen2.5-VL adds its vision tower under ``visual.``
(vLLM's ``Qwen2_5_VisionTransformer``: the checkpoint's fused ``attn.qkv`` split head-wise third by
third as ``QKVParallelLinear`` does, ``mlp.gate_up_proj`` fused from gate and up, ``attn.proj`` /
``down_proj`` / the projector's ``mlp.2`` row-parallel with whole biases, the patch Conv3d and the
norms replicated — or the whole tower replicated, ``vision_dp``: vLLM's ``mm_encoder_tp_mode="data"``)
and serves the language model as ``language_model.model.*`` / ``language_model.lm_head.weight``
(vllm/model_executor/models/qwen2_5_vl.py, its ``hf_to_vllm_mapper``). The generic layout machinery (parts, blocks,
chunk rules, checks) is :mod:`.layout`; the model numbers are :mod:`.models`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperrl.sharding.layout import ChunkRule, DstLayout, DstParam, LayoutError, Part
from hyperrl.sharding.mesh import Mesh
from hyperrl.sharding.models import (
    ModelShape,
    VisionShape,
    check_tensor_parallel,
    hf_tensor_shapes,
    language_model_name,
    vision_tensor_shapes,
)
from hyperrl.sharding.spec import Box, Spec

__all__ = ["HeadReplicaRule", "rollout_layout", "padded_vocab", "worker_cuts"]


@dataclass(frozen=True)
class HeadReplicaRule:
    """vLLM ``QKVParallelLinear`` k/v: ``n_heads`` heads of ``head_dim`` rows along ``dim`` over
    mesh axis ``axis`` (size tp). ``tp ≥ n`` → replicas = tp / n, rank r holds head r // replicas;
    ``tp < n`` → n / tp heads per rank. Other dims whole."""

    axis: str
    n_heads: int
    head_dim: int
    dim: int = 0

    def box(self, shape: tuple[int, ...], mesh: Mesh, coords: dict) -> Box:
        tp, r = mesh.axis_size(self.axis), coords[self.axis]
        if tp >= self.n_heads:
            if tp % self.n_heads:
                raise LayoutError(f"kv heads: tp={tp} is not a multiple of n_kv={self.n_heads}")
            lo, n = (r // (tp // self.n_heads)) * self.head_dim, self.head_dim
        else:
            if self.n_heads % tp:
                raise LayoutError(f"kv heads: n_kv={self.n_heads} is not divisible by tp={tp}")
            per = self.n_heads // tp
            lo, n = r * per * self.head_dim, per * self.head_dim
        offs = [0] * len(shape)
        sizes = list(shape)
        offs[self.dim], sizes[self.dim] = lo, n
        return Box(tuple(offs), tuple(sizes))

    def check(self, shape: tuple[int, ...], mesh: Mesh, where: str) -> None:
        """The rule fits a part of ``shape`` on ``mesh``: its axis exists, its heads cover the dim."""
        if self.axis not in mesh.names:
            raise LayoutError(f"{where}: kv-head axis {self.axis!r} is not a destination mesh axis {list(mesh.names)}")
        if not 0 <= self.dim < len(shape) or self.n_heads * self.head_dim != shape[self.dim]:
            raise LayoutError(f"{where}: {self.n_heads} kv heads × {self.head_dim} rows cover "
                              f"{self.n_heads * self.head_dim} rows of dim {self.dim}, the part has "
                              f"{shape[self.dim] if 0 <= self.dim < len(shape) else 'no such dim'}")


def padded_vocab(n: int) -> int:
    """vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead`` rows: ``n`` rounded up to a multiple of 64."""
    return -(-n // 64) * 64


def rollout_layout(cfg: ModelShape, *, tp: int, dp: int = 1, ep: int = 1, expert_placement: str = "linear",
                   dtype=torch.bfloat16, offset: int = 0, stacked_experts: bool = False,
                   vision_dp: bool = False) -> DstLayout:
    """vLLM's parameter layout on a ``dp × tp`` mesh (see module doc). ``ep`` ∈ {1, dp·tp} — or ``tp``:
    experts split over each TP group's ranks and replicated over the ``dp`` replicas (the transformers TP
    engine's layout of a mixture, :mod:`hyperrl.rollout.tp`; vLLM's own when ``dp = 1``).
    ``stacked_experts``: the sources are transformers ≥ 5's stacked experts — ``mlp.experts.gate_up_proj
    [E, 2I, H]`` (each expert's gate rows then its up rows: vLLM's ``w13_weight`` row for row) and
    ``mlp.experts.down_proj [E, H, I]`` (``w2_weight``) — instead of the checkpoint's per-expert
    tensors; whole experts only (``tp = 1`` or expert parallelism, linear placement): a
    tensor-parallel ``w13`` interleaves the gate and up halves of every expert, which whole-tensor
    blocks of ``gate_up_proj`` cannot express. ``vision_dp``: a vision-language model's tower whole on every
    rank (vLLM's ``mm_encoder_tp_mode="data"``) instead of tensor-parallel like the language model."""
    if vision_dp and cfg.vision is None:
        raise ValueError(f"vision_dp: {cfg.name} has no vision tower")
    if cfg.vision is not None:
        text = rollout_layout(replace(cfg, vision=None), tp=tp, dp=dp, ep=ep, expert_placement=expert_placement,
                              dtype=dtype, offset=offset, stacked_experts=stacked_experts)
        tower = _vision_layout(cfg.vision, Mesh.of(dp=dp, tp=tp, offset=offset), dtype, replicated=vision_dp)
        return DstLayout(tower | {_vl_dst(n): _renamed(p, language_model_name) for n, p in text.params.items()})
    if ep not in (1, tp, dp * tp):
        raise ValueError(f"ep={ep}: vLLM expert parallelism spans all dp×tp={dp * tp} ranks (or ep=1; ep=tp splits "
                         "the experts over each TP group)")
    if expert_placement not in ("linear", "round_robin"):
        raise ValueError(f"expert_placement={expert_placement!r}; choose 'linear' or 'round_robin'")
    if cfg.experts and ep > 1 and cfg.experts % ep:
        raise ValueError(f"ep={ep} does not divide {cfg.experts} experts")
    if not cfg.experts and ep != 1:
        raise ValueError(f"ep={ep}: {cfg.name} has no experts")
    check_tensor_parallel(cfg, tp, ep=ep, where="rollout tp")
    if padded_vocab(cfg.vocab) % tp:
        raise ValueError(f"rollout tp={tp}: vLLM pads the vocabulary ({cfg.vocab}) to {padded_vocab(cfg.vocab)} rows, "
                         f"which {tp} ranks cannot split evenly")
    mesh = Mesh.of(dp=dp, tp=tp, offset=offset)
    shapes = hf_tensor_shapes(cfg)
    col, row = ChunkRule(Spec.shard(2, d0="tp")), ChunkRule(Spec.shard(2, d1="tp"))
    params: dict[str, DstParam] = {}

    def add(name, parts, cat_dim=0, dt=dtype):
        params[name] = DstParam(dt, mesh, tuple(parts), cat_dim)

    def plain(src, rule=None, pad=None):
        shape = shapes[src]
        return Part.plain(src, shape, rule or ChunkRule(Spec.replicate(len(shape))), pad)

    add("model.embed_tokens.weight", [plain("model.embed_tokens.weight", col, (padded_vocab(cfg.vocab), cfg.hidden))])
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.mla:
            add(a + "fused_qkv_a_proj.weight", [plain(a + "q_a_proj.weight"), plain(a + "kv_a_proj_with_mqa.weight")])
            add(a + "q_b_proj.weight", [plain(a + "q_b_proj.weight", col)])
            add(a + "kv_b_proj.weight", [plain(a + "kv_b_proj.weight", col)])
            for n in ("q_a_layernorm.weight", "kv_a_layernorm.weight"):
                add(a + n, [plain(a + n)])
        else:
            kv = HeadReplicaRule("tp", cfg.kv_heads, cfg.head_dim)
            add(a + "qkv_proj.weight", [plain(a + "q_proj.weight", col), plain(a + "k_proj.weight", kv),
                                        plain(a + "v_proj.weight", kv)])
            if cfg.qkv_bias:
                add(a + "qkv_proj.bias", [plain(a + "q_proj.bias", ChunkRule(Spec.shard(1, d0="tp"))),
                                          plain(a + "k_proj.bias", kv), plain(a + "v_proj.bias", kv)])
            if cfg.qk_norm:
                for n in ("q_norm.weight", "k_norm.weight"):
                    add(a + n, [plain(a + n)])
        add(a + "o_proj.weight", [plain(a + "o_proj.weight", row)])
        m = p + "mlp."
        if cfg.is_moe(i):
            add(m + "gate.weight", [plain(m + "gate.weight")])
            if cfg.mla:
                add(m + "gate.e_score_correction_bias", [plain(m + "gate.e_score_correction_bias")], dt=torch.float32)
            if cfg.shared_experts:
                s = m + "shared_experts."
                add(s + "gate_up_proj.weight", [plain(s + "gate_proj.weight", col), plain(s + "up_proj.weight", col)])
                add(s + "down_proj.weight", [plain(s + "down_proj.weight", row)])
            if cfg.shared_intermediate:
                s = m + "shared_expert."
                add(s + "gate_up_proj.weight", [plain(s + "gate_proj.weight", col), plain(s + "up_proj.weight", col)])
                add(s + "down_proj.weight", [plain(s + "down_proj.weight", row)])
                add(m + "shared_expert_gate.weight", [plain(m + "shared_expert_gate.weight")])
            E, I, H = cfg.experts, cfg.expert_intermediate, cfg.hidden
            if ep > 1:
                order = list(range(E)) if expert_placement == "linear" else \
                    [(e % ep) * (E // ep) + e // ep for e in range(E)]
                up_rule = down_rule = ChunkRule(Spec.shard(3, d0=("dp", "tp") if ep == dp * tp else "tp"))
            else:
                order = None
                up_rule, down_rule = ChunkRule(Spec.shard(3, d1="tp")), ChunkRule(Spec.shard(3, d2="tp"))
            if stacked_experts:
                if (tp > 1 and ep == 1) or (ep > 1 and expert_placement != "linear"):
                    raise LayoutError(f"{m}experts: stacked sources (gate_up_proj) reach vLLM's w13_weight only as "
                                      f"whole experts (tp=1, or ep with linear placement); got tp={tp}, ep={ep}, "
                                      f"{expert_placement}")
                add(m + "experts.w13_weight", [Part.plain(m + "experts.gate_up_proj", (E, 2 * I, H), up_rule)])
                add(m + "experts.w2_weight", [Part.plain(m + "experts.down_proj", (E, H, I), down_rule)])
                for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                    add(p + n, [plain(p + n)])
                continue
            names = [f"{m}experts.{e}." for e in range(E)]
            gate = Part.stacked([n + "gate_proj.weight" for n in names], (I, H), up_rule, order)
            up = Part.stacked([n + "up_proj.weight" for n in names], (I, H), up_rule, order)
            add(m + "experts.w13_weight", [gate, up], cat_dim=1)
            add(m + "experts.w2_weight", [Part.stacked([n + "down_proj.weight" for n in names], (H, I), down_rule,
                                                       order)])
        else:
            add(m + "gate_up_proj.weight", [plain(m + "gate_proj.weight", col), plain(m + "up_proj.weight", col)])
            add(m + "down_proj.weight", [plain(m + "down_proj.weight", row)])
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            add(p + n, [plain(p + n)])
    add("model.norm.weight", [plain("model.norm.weight")])
    if not cfg.tied:
        add("lm_head.weight", [plain("lm_head.weight", col, (padded_vocab(cfg.vocab), cfg.hidden))])
    return DstLayout(params)


def _vl_dst(name: str) -> str:  # a text model's vLLM parameter → vLLM's Qwen2.5-VL one (its hf_to_vllm_mapper)
    return "language_model." + name


def _renamed(p: DstParam, src) -> DstParam:
    parts = tuple(replace(part, blocks=tuple(replace(b, src=src(b.src)) for b in part.blocks)) for part in p.parts)
    return replace(p, parts=parts)


def _vision_layout(v: VisionShape, mesh: Mesh, dtype, *, replicated: bool) -> dict[str, DstParam]:
    """vLLM's ``visual.*`` parameters of a Qwen2.5-VL tower (see the module doc) from the HF ``model.visual.*``
    tensors, on ``mesh`` (tensor-parallel over its ``tp`` axis unless ``replicated``)."""
    tp = 1 if replicated else mesh.axis_size("tp")
    for what, n in (("heads", v.heads), ("MLP width", v.intermediate), ("projector width", v.merger_hidden)):
        if n % tp:
            raise ValueError(f"rollout tp={tp}: the vision tower's {what} {n} is not divisible by {tp} (vLLM splits "
                             f"it over the tensor-parallel ranks); serve the tower data-parallel "
                             f"(mm_encoder_tp_mode='data', vision_dp=True) or choose tp dividing it")
    shapes = vision_tensor_shapes(v)
    axis = None if replicated else "tp"
    rep = {n: ChunkRule(Spec.replicate(k)) for n, k in ((1, 1), (2, 2), (5, 5))}
    col = {k: ChunkRule(Spec.shard(k, d0=axis)) if axis else rep[k] for k in (1, 2)}
    row = ChunkRule(Spec.shard(2, d1=axis)) if axis else rep[2]
    out: dict[str, DstParam] = {}

    def add(name, parts):
        out["visual." + name] = DstParam(dtype, mesh, tuple(parts))

    def plain(name, rule=None):
        shape = shapes["model.visual." + name]
        return Part.plain("model.visual." + name, shape, rule or rep[len(shape)])

    add("patch_embed.proj.weight", [plain("patch_embed.proj.weight")])
    D = v.hidden
    for i in range(v.depth):
        b = f"blocks.{i}."
        for n in ("norm1.weight", "norm2.weight", "attn.proj.bias", "mlp.down_proj.bias"):
            add(b + n, [plain(b + n)])
        for n in ("weight", "bias"):  # q, k and v thirds of the checkpoint's fused tensor, each split by heads
            src = f"model.visual.{b}attn.qkv.{n}"
            add(f"{b}attn.qkv.{n}", [Part.window(src, shapes[src], 0, k * D, D, col[len(shapes[src])])
                                     for k in range(3)])
            add(f"{b}mlp.gate_up_proj.{n}", [plain(f"{b}mlp.gate_proj.{n}", col[len(shapes[src])]),
                                             plain(f"{b}mlp.up_proj.{n}", col[len(shapes[src])])])
        add(b + "attn.proj.weight", [plain(b + "attn.proj.weight", row)])
        add(b + "mlp.down_proj.weight", [plain(b + "mlp.down_proj.weight", row)])
    add("merger.ln_q.weight", [plain("merger.ln_q.weight")])
    add("merger.mlp.0.weight", [plain("merger.mlp.0.weight", col[2])])
    add("merger.mlp.0.bias", [plain("merger.mlp.0.bias", col[1])])
    add("merger.mlp.2.weight", [plain("merger.mlp.2.weight", row)])
    add("merger.mlp.2.bias", [plain("merger.mlp.2.bias")])
    return out


def worker_cuts(whole: DstParam, split: DstParam) -> list[list[tuple[Box, Box, int]]]:
    """Where each tensor-parallel worker's shard of a vLLM parameter lies in the parameter whole: for each
    position of ``split``'s mesh (vLLM's layout at ``tp = N``), ``[(box in the whole parameter, box in the
    worker's local shard, real elements)]`` — one per part (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``).
    ``whole`` is the same parameter at ``tp = 1`` (the parts end to end along ``cat_dim``, padding included).
    ``real elements`` excludes padding (a padded vocabulary's rows no source fills): what the direct plan sends
    that worker — summed over a model, each worker's ``B_recv_min``."""
    if len(whole.parts) != len(split.parts) or whole.cat_dim != split.cat_dim:
        raise LayoutError(f"worker_cuts: {len(whole.parts)} parts at tp=1, {len(split.parts)} split")
    cat, out = split.cat_dim, []
    starts = [sum(p.shape[cat] for p in whole.parts[:j]) for j in range(len(whole.parts))]
    for pos in range(split.mesh.size):
        cuts = []
        for j, (part, box) in enumerate(zip(split.parts, split.local_boxes[pos])):
            src = Box(tuple(o + (starts[j] if d == cat else 0) for d, o in enumerate(box.offsets)), box.sizes)
            dst = Box(tuple(split.cat_offset(pos, j) if d == cat else 0 for d in range(len(box.sizes))), box.sizes)
            real = sum(hit.numel for b in part.blocks if (hit := box.intersect(b.virtual_box())) is not None)
            cuts.append((src, dst, real))
        out.append(cuts)
    return out
