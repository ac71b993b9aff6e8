"""A tiny Qwen3-architecture causal LM randomly initialised from a config (no hub download)."""

from __future__ import annotations

import torch

__all__ = ["tiny_qwen3", "tiny_qwen3_moe", "tiny_qwen2_5_vl"]


def tiny_qwen3(vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1,
               head_dim: int = 32, intermediate: int = 128, seed: int = 0, dtype=torch.float32, pad_id: int = 0,
               bos_id: int | None = 1, eos_id: int = 2, max_positions: int = 512):
    """A randomly initialised Qwen3-architecture causal LM from a config (no hub access); the
    special ids default to the character tokenizer's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      intermediate_size=intermediate, max_position_embeddings=max_positions, tie_word_embeddings=True,
                      pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    model.eval()
    return model


def tiny_qwen3_moe(vocab_size: int, *, experts: int = 8, top_k: int = 2, moe_intermediate: int = 64,
                   router_aux_loss_coef: float = 0.001, hidden: int = 64, layers: int = 2, heads: int = 2,
                   kv_heads: int = 1, head_dim: int = 32, seed: int = 0, dtype=torch.float32, pad_id: int = 0,
                   bos_id: int | None = 1, eos_id: int = 2, max_positions: int = 512):
    """A randomly initialised Qwen3-MoE causal LM: every layer sparse (``experts`` experts of width
    ``moe_intermediate``, ``top_k`` per token, top-k weights renormalised as Qwen3-30B-A3B does),
    experts stacked (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), router
    ``mlp.gate`` (returns logits, weights, ids)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if not 1 <= top_k <= experts:
        raise ValueError(f"model.experts_per_token={top_k}: must be in 1..model.experts ({experts})")
    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate,
                         intermediate_size=moe_intermediate, decoder_sparse_step=1, mlp_only_layers=[],
                         norm_topk_prob=True, router_aux_loss_coef=router_aux_loss_coef,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(dtype)
    model.eval()
    return model


def tiny_qwen2_5_vl(vocab_size: int, *, image_token_id: int, vision_start_id: int, vision_end_id: int,
                    video_token_id: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, vision_hidden: int = 32, vision_depth: int = 2, vision_heads: int = 2,
                    seed: int = 0, dtype=torch.float32, pad_id: int = 0, bos_id: int | None = 1, eos_id: int = 2,
                    max_positions: int = 512, rope_theta: float = 1e6):
    """A randomly initialised Qwen2.5-VL (its vision tower included: ``vision_depth`` blocks of ``vision_hidden``,
    patch 14, 2×2 merge — an image of grid ``[1, h, w]`` takes ``h·w / 4`` ``image_token_id`` placeholders; the
    language model ``layers`` × ``hidden`` with M-RoPE sections sized to its head). The special ids are the
    tokenizer's own. ``rope_theta``: the rotary base (Qwen2.5-VL's 1e6 by default; M-RoPE gives the height and
    width axes the *last* frequency pairs, ``theta^(−i/(head/2))`` — with a 16-dim head and 1e6 those rotate by
    1e-3 … 6e-6 rad a position, so neighbouring image tokens are indistinguishable by position; a small model on
    short prompts needs a small base, e.g. 10)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    half = (hidden // heads) // 2  # M-RoPE splits each head's rotary half over (t, h, w)
    section = [half - 2 * (half // 3), half // 3, half // 3]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, pad_token_id=pad_id,
                         bos_token_id=bos_id, eos_token_id=eos_id,
                         rope_parameters={"rope_type": "default", "mrope_section": section,
                                          "rope_theta": float(rope_theta)}),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_heads=vision_heads, out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[vision_depth - 1]),
        image_token_id=image_token_id, video_token_id=video_token_id, vision_start_token_id=vision_start_id,
        vision_end_token_id=vision_end_id, tie_word_embeddings=True, pad_token_id=pad_id, bos_token_id=bos_id,
        eos_token_id=eos_id)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)
    model.eval()
    return model
