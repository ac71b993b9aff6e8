"""Model layouts from config numbers (no weights): Qwen2 / Qwen3 / Llama dense, Qwen2-MoE /
Qwen3-MoE, DeepSeek-V3 (MLA), Qwen2.5-VL (its vision tower and projector beside the language
model) — from the table ``MODELS`` or an HF ``config.json`` (:func:`from_hf_config`) — and the
trainer's side of them.

``trainer_layout(cfg, fsdp=, tp=, ep=)`` is the HF state dict as FSDP2 (+ TP, + EP) would
shard it with DTensor: dense tensors are sharded on dim 0 over ``fsdp × ep`` (after TP on dim 0
for column-parallel weights — the ``_StridedShard`` order), row-parallel weights on dim 1 by TP;
routed experts are separate HF tensors living on their EP group's sub-mesh (``fsdp × tp``),
placed linearly (expert e on group ``e // (E/ep)``). The engine's side — vLLM's fused and padded
parameters — is :mod:`.vllm`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperrl.sharding.layout import Layout, Placement
from hyperrl.sharding.mesh import Mesh
from hyperrl.sharding.spec import Spec

__all__ = ["ModelShape", "VisionShape", "MODELS", "trainer_layout", "hf_tensor_shapes", "parse_parallel",
           "from_hf_config"]


@dataclass(frozen=True)
class VisionShape:
    """A Qwen2.5-VL vision tower's numbers: ``depth`` blocks of ``hidden`` (``heads`` heads, a gated MLP of
    ``intermediate``, biases on every linear layer, RMSNorm), a Conv3d patch embedding (``in_channels`` ×
    ``temporal_patch`` × ``patch`` × ``patch``), and the projector (``merger``: RMSNorm, then an MLP from the
    ``merge``² concatenated patches, ``hidden·merge²`` wide, to the language model's ``out_hidden``)."""

    depth: int
    hidden: int
    heads: int
    intermediate: int
    out_hidden: int
    patch: int = 14
    temporal_patch: int = 2
    in_channels: int = 3
    merge: int = 2

    @property
    def merger_hidden(self) -> int:
        return self.hidden * self.merge ** 2


@dataclass(frozen=True)
class ModelShape:
    """A model's numbers as the planner needs them (hidden size, layers, heads, experts, …) — not the
    run's ``model`` config section (:class:`hyperrl.config.ModelConfig`)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP
    vocab: int
    tied: bool
    experts: int = 0
    expert_intermediate: int = 0
    first_dense: int = 0  # leading dense layers in an MoE model
    shared_experts: int = 0
    mla: tuple[int, int, int, int, int] | None = None  # q_lora, kv_lora, nope, rope, v
    qk_norm: bool = True  # Qwen3's q_norm / k_norm (Qwen2, Llama: none)
    qkv_bias: bool = False  # Qwen2's q/k/v biases
    shared_intermediate: int = 0  # a single shared expert of this width (Qwen2-MoE: mlp.shared_expert + its gate)
    sparse_step: int = 1  # Qwen-MoE decoder_sparse_step: layer i is MoE when (i + 1) % step == 0
    dense_layers: tuple[int, ...] = ()  # Qwen-MoE mlp_only_layers
    # a vision-language model's tower (Qwen2.5-VL): its tensors are ``model.visual.*``, the language model's
    # ``model.language_model.*`` (transformers ≥ 4.52 names), the head ``lm_head.weight``
    vision: VisionShape | None = None

    def is_moe(self, layer: int) -> bool:
        return (self.experts > 0 and layer >= self.first_dense and layer not in self.dense_layers
                and (layer + 1) % self.sparse_step == 0)


MODELS = {
    "qwen3-4b": ModelShape("qwen3-4b", 2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-0.6b": ModelShape("qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-8b": ModelShape("qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 2048, 48, 32, 4, 128, 6144, 151936, False, 128, 768),
    "deepseek-v3": ModelShape("deepseek-v3", 7168, 61, 128, 128, 128, 18432, 129280, False, 256, 2048, 3, 1,
                               (1536, 512, 128, 64, 128)),
    # Qwen2.5-VL (the released config.json numbers): one 32-block tower of 1280 (16 heads, MLP 3420) on each
    "qwen2.5-vl-3b": ModelShape("qwen2.5-vl-3b", 2048, 36, 16, 2, 128, 11008, 151936, True, qk_norm=False,
                                qkv_bias=True, vision=VisionShape(32, 1280, 16, 3420, 2048)),
    "qwen2.5-vl-7b": ModelShape("qwen2.5-vl-7b", 3584, 28, 28, 4, 128, 18944, 152064, False, qk_norm=False,
                                qkv_bias=True, vision=VisionShape(32, 1280, 16, 3420, 3584)),
    # tiny shapes with the same structure, for execution tests
    "qwen3-tiny": ModelShape("qwen3-tiny", 64, 2, 4, 2, 16, 96, 250, True),
    "qwen3-moe-tiny": ModelShape("qwen3-moe-tiny", 32, 2, 4, 2, 8, 48, 130, False, 8, 24),
    "qwen2.5-vl-tiny": ModelShape("qwen2.5-vl-tiny", 32, 2, 4, 2, 8, 48, 100, False, qk_norm=False, qkv_bias=True,
                                  vision=VisionShape(2, 16, 4, 24, 32)),
    "deepseek-tiny": ModelShape("deepseek-tiny", 32, 3, 4, 4, 8, 48, 100, False, 8, 16, 1, 1, (24, 16, 8, 4, 8)),
}


def vision_tensor_shapes(v: VisionShape, prefix: str = "model.visual.") -> dict[str, tuple[int, ...]]:
    """A Qwen2.5-VL vision tower's tensors (transformers' names under ``prefix``), in state-dict order: the
    checkpoint already fuses each block's q, k and v (``attn.qkv``), and keeps the MLP's gate and up apart."""
    D, I, M = v.hidden, v.intermediate, v.merger_hidden
    out = {prefix + "patch_embed.proj.weight": (D, v.in_channels, v.temporal_patch, v.patch, v.patch)}
    for i in range(v.depth):
        b = f"{prefix}blocks.{i}."
        out |= {b + "norm1.weight": (D,), b + "norm2.weight": (D,), b + "attn.qkv.weight": (3 * D, D),
                b + "attn.qkv.bias": (3 * D,), b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
                b + "mlp.gate_proj.weight": (I, D), b + "mlp.gate_proj.bias": (I,),
                b + "mlp.up_proj.weight": (I, D), b + "mlp.up_proj.bias": (I,),
                b + "mlp.down_proj.weight": (D, I), b + "mlp.down_proj.bias": (D,)}
    out |= {prefix + "merger.ln_q.weight": (D,), prefix + "merger.mlp.0.weight": (M, M),
            prefix + "merger.mlp.0.bias": (M,), prefix + "merger.mlp.2.weight": (v.out_hidden, M),
            prefix + "merger.mlp.2.bias": (v.out_hidden,)}
    return out


def language_model_name(name: str) -> str:
    """A text model's tensor name as a vision-language model holds it (transformers ≥ 4.52:
    ``model.layers.0.…`` → ``model.language_model.layers.0.…``; ``lm_head.weight`` unchanged)."""
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def hf_tensor_shapes(cfg: ModelShape) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint's tensor names and shapes, in state-dict order. A vision-language model: the tower
    first, then the language model, named as the model holds them (``model.visual.*``,
    ``model.language_model.*``) — the names a publisher sends; transformers saves (and loads) the original
    ``visual.*`` / ``model.*``, and vLLM's loader takes either."""
    if cfg.vision is not None:
        text = hf_tensor_shapes(replace(cfg, vision=None))
        return vision_tensor_shapes(cfg.vision) | {language_model_name(k): v for k, v in text.items()}
    H, out = cfg.hidden, {"model.embed_tokens.weight": (cfg.vocab, cfg.hidden)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        if cfg.mla:
            ql, kvl, nope, rope, v = cfg.mla
            out |= {p + "self_attn.q_a_proj.weight": (ql, H), p + "self_attn.q_a_layernorm.weight": (ql,),
                    p + "self_attn.q_b_proj.weight": (cfg.heads * (nope + rope), ql),
                    p + "self_attn.kv_a_proj_with_mqa.weight": (kvl + rope, H),
                    p + "self_attn.kv_a_layernorm.weight": (kvl,),
                    p + "self_attn.kv_b_proj.weight": (cfg.heads * (nope + v), kvl),
                    p + "self_attn.o_proj.weight": (H, cfg.heads * v)}
        else:
            hd, a = cfg.head_dim, p + "self_attn."
            for n, rows in (("q_proj", cfg.heads * hd), ("k_proj", cfg.kv_heads * hd), ("v_proj", cfg.kv_heads * hd)):
                out[a + n + ".weight"] = (rows, H)
                if cfg.qkv_bias:
                    out[a + n + ".bias"] = (rows,)
            out[a + "o_proj.weight"] = (H, cfg.heads * hd)
            if cfg.qk_norm:
                out |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        if cfg.is_moe(i):
            E, I = cfg.experts, cfg.expert_intermediate
            out[p + "mlp.gate.weight"] = (E, H)
            if cfg.mla:
                out[p + "mlp.gate.e_score_correction_bias"] = (E,)
            if cfg.shared_experts:
                SI = I * cfg.shared_experts
                out |= {p + "mlp.shared_experts.gate_proj.weight": (SI, H),
                        p + "mlp.shared_experts.up_proj.weight": (SI, H),
                        p + "mlp.shared_experts.down_proj.weight": (H, SI)}
            if cfg.shared_intermediate:
                SI = cfg.shared_intermediate
                out |= {p + "mlp.shared_expert.gate_proj.weight": (SI, H),
                        p + "mlp.shared_expert.up_proj.weight": (SI, H),
                        p + "mlp.shared_expert.down_proj.weight": (H, SI),
                        p + "mlp.shared_expert_gate.weight": (1, H)}
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                out |= {q + "gate_proj.weight": (I, H), q + "up_proj.weight": (I, H), q + "down_proj.weight": (H, I)}
        else:
            out |= {p + "mlp.gate_proj.weight": (cfg.intermediate, H), p + "mlp.up_proj.weight": (cfg.intermediate, H),
                    p + "mlp.down_proj.weight": (H, cfg.intermediate)}
        out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    out["model.norm.weight"] = (H,)
    if not cfg.tied:
        out["lm_head.weight"] = (cfg.vocab, H)
    return out


# the vision tower's (Qwen2.5-VL) beside the language model's: attn.proj and the projector's second linear are
# row-parallel; attn.qkv, the MLP's gate / up and the projector's first linear column-parallel, biases included
_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight", "attn.proj.weight", "merger.mlp.2.weight")
_REPLICATED_2D = ("mlp.gate.weight", "q_a_proj.weight", "kv_a_proj_with_mqa.weight", "shared_expert_gate.weight")
_COLUMN_BIAS = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "attn.qkv.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias",
                "merger.mlp.0.bias")


def _dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


def trainer_layout(cfg: ModelShape, *, fsdp: int, tp: int = 1, ep: int = 1, dtype=torch.bfloat16,
                   offset: int = 0) -> Layout:
    """FSDP2 × TP × EP placements of every HF tensor (see module doc)."""
    if cfg.experts and cfg.experts % ep:
        raise ValueError(f"ep={ep} does not divide {cfg.experts} experts")
    if not cfg.experts and ep != 1:
        raise ValueError(f"ep={ep}: {cfg.name} has no experts")
    check_tensor_parallel(cfg, tp, ep=ep, where="trainer tp")
    mesh = Mesh.of(fsdp=fsdp, ep=ep, tp=tp, offset=offset)
    groups = [mesh.submesh(ep=k) for k in range(ep)]
    per_group = cfg.experts // ep if cfg.experts else 0
    out = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        if ".experts." in name and ".shared_experts." not in name:
            e = int(name.split(".experts.")[1].split(".")[0])
            m = groups[e // per_group]
            spec = Spec.shard(2, d0="fsdp", d1="tp") if name.endswith(_ROW_PARALLEL) else \
                Spec.shard(2, d0=("tp", "fsdp"))
            out[name] = Placement(shape, dtype, spec, m)
            continue
        if name.endswith(_COLUMN_BIAS):  # a column-parallel layer's bias: TP on its rows, like the weight
            spec = Spec.shard(1, d0=("tp", "fsdp", "ep"))
        elif len(shape) != 2 or name.endswith(_REPLICATED_2D):  # norms, row-parallel biases, the patch Conv3d
            spec = Spec.shard(len(shape), d0=("fsdp", "ep"))
        elif name.endswith(_ROW_PARALLEL):
            spec = Spec.shard(2, d0=("fsdp", "ep"), d1="tp")
        else:
            spec = Spec.shard(2, d0=("tp", "fsdp", "ep"))
        out[name] = Placement(shape, _dtype(name, dtype), spec, mesh)
    return Layout(out)


def parse_parallel(text: str) -> dict[str, int]:
    """``"fsdp=64,ep=16"`` → ``{"fsdp": 64, "ep": 16}`` (clear errors for malformed input)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if "=" not in item:
            raise ValueError(f"{text!r}: expected comma-separated axis=size, got {item!r}")
        k, v = item.split("=", 1)
        k, v = k.strip(), v.strip()
        if not v.isdigit() or int(v) < 1:
            raise ValueError(f"{text!r}: size of {k!r} must be a positive integer, got {v!r}")
        if k in out:
            raise ValueError(f"{text!r}: axis {k!r} is given twice ({out[k]} and {v}); give each axis once")
        out[k] = int(v)
    return out


def check_tensor_parallel(cfg: ModelShape, tp: int, *, ep: int = 1, where: str = "tp") -> None:
    """The split rules vLLM (and a Megatron-style trainer) apply to ``tp``: query heads divisible
    by ``tp`` (a split never lands mid-head), kv heads either divisible by ``tp`` or dividing it
    (then replicated), MLA heads likewise, an MoE expert's width divisible by ``tp`` when experts
    are not expert-parallel. Raises ``ValueError`` naming the number and the sizes that fit."""
    def fits(n: int) -> str:
        return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

    if cfg.heads % tp:
        raise ValueError(f"{where}={tp}: {cfg.name} has {cfg.heads} attention heads, which {tp} ranks cannot split "
                         f"evenly (vLLM requires heads % tp == 0); tp ∈ {{{fits(cfg.heads)}}}")
    if not cfg.mla and cfg.kv_heads % tp and tp % cfg.kv_heads:
        raise ValueError(f"{where}={tp}: {cfg.name} has {cfg.kv_heads} key/value heads; tp must divide them or be a "
                         f"multiple of them (replicated heads)")
    if cfg.experts and ep == 1 and cfg.expert_intermediate % tp:
        raise ValueError(f"{where}={tp}: the experts' width {cfg.expert_intermediate} is not divisible by {tp}")
    if cfg.intermediate % tp:
        raise ValueError(f"{where}={tp}: the MLP width {cfg.intermediate} is not divisible by {tp}")


_DENSE = ("qwen2", "qwen3", "llama", "mistral")
_MOE = ("qwen2_moe", "qwen3_moe")
_MLA = ("deepseek_v3",)
_VL = ("qwen2_5_vl",)


def _number(c: dict, key: str, *aliases: str, missing: str, default: int | None = None) -> int:
    """``c[key]`` (or the first of ``aliases`` set) as an int; ``default`` when none is, else ``missing`` raised."""
    for k in (key, *aliases):
        if c.get(k) is not None:
            return int(c[k])
    if default is None:
        raise ValueError(missing)
    return default


def _vision_shape(c: dict, where: str) -> VisionShape:
    """A Qwen2.5-VL config's ``vision_config`` as a :class:`VisionShape` (a missing number named)."""
    v = c.get("vision_config")
    if not isinstance(v, dict):
        raise ValueError(f"{where}: qwen2_5_vl without a vision_config")

    def need(key, *aliases, default=None):
        return _number(v, key, *aliases, default=default,
                       missing=f"{where}: vision_config.{key} is missing (qwen2_5_vl needs it)")

    return VisionShape(depth=need("depth"), hidden=need("hidden_size", "embed_dim"), heads=need("num_heads"),
                       intermediate=need("intermediate_size"), out_hidden=need("out_hidden_size"),
                       patch=need("patch_size", default=14), temporal_patch=need("temporal_patch_size", default=2),
                       in_channels=need("in_channels", "in_chans", default=3),
                       merge=need("spatial_merge_size", default=2))


def from_hf_config(source) -> ModelShape:
    """A :class:`ModelShape` from an HF ``config.json`` (a path to the file or its directory,
    or the parsed dict): Qwen2 / Qwen3 / Llama / Mistral dense, Qwen2-MoE / Qwen3-MoE, DeepSeek-V3
    (MLA), Qwen2.5-VL (the released flat config or transformers ≥ 5's ``text_config``; the language model is
    Qwen2's). An unsupported ``model_type`` or a missing field is an error naming it."""
    import json
    from pathlib import Path

    if isinstance(source, dict):
        c, where = source, "config"
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{source}: no such file (expected an HF config.json or a directory holding one)")
        c, where = json.loads(path.read_text()), str(path)
    kind = c.get("model_type")
    if kind not in _DENSE + _MOE + _MLA + _VL:
        raise ValueError(f"{where}: model_type {kind!r} is not modelled; supported: "
                         f"{', '.join(_DENSE + _MOE + _MLA + _VL)}")
    name = c.get("_name_or_path") or Path(where).parent.name or kind  # ("config", a dict: no parent name)
    if kind in _VL:
        text = {**c, **(c.get("text_config") or {}), "model_type": "qwen2"}
        text.setdefault("tie_word_embeddings", c.get("tie_word_embeddings", False))
        return replace(from_hf_config(text), name=name, vision=_vision_shape(c, where))

    def need(key, *aliases):  # aliases: names other releases write for the same number
        return _number(c, key, *aliases, missing=f"{where}: {key!r} is missing ({kind} needs it)")

    H, heads = need("hidden_size"), need("num_attention_heads")
    common = dict(name=name, hidden=H,
                  layers=need("num_hidden_layers"), heads=heads,
                  kv_heads=int(c.get("num_key_value_heads") or heads),
                  head_dim=int(c.get("head_dim") or H // heads), intermediate=need("intermediate_size"),
                  vocab=need("vocab_size"), tied=bool(c.get("tie_word_embeddings", False)))
    if kind in _MLA:
        if c.get("q_lora_rank") is None:
            raise ValueError(f"{where}: q_lora_rank is null (DeepSeek-V2-Lite style q_proj) — not modelled")
        mla = tuple(need(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                      "v_head_dim"))
        return ModelShape(**common, experts=need("n_routed_experts", "num_local_experts"),
                           expert_intermediate=need("moe_intermediate_size"),
                           first_dense=int(c.get("first_k_dense_replace", 0)),
                           shared_experts=int(c.get("n_shared_experts") or 0), mla=mla, qk_norm=False)
    qwen = kind.startswith("qwen")
    flags = dict(qk_norm=kind.startswith("qwen3"), qkv_bias=kind.startswith("qwen2"))
    if kind in _MOE:
        return ModelShape(**common, experts=need("num_experts", "num_local_experts"),
                           expert_intermediate=need("moe_intermediate_size"),
                           shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0),
                           sparse_step=int(c.get("decoder_sparse_step") or 1),
                           dense_layers=tuple(int(i) for i in c.get("mlp_only_layers") or ()), **flags)
    for key in ("attention_bias", "mlp_bias"):
        if not qwen and c.get(key):
            raise ValueError(f"{where}: {key}=true (biases on o_proj / the MLP) is not modelled")
    return ModelShape(**common, **flags)
