"""A tiny Qwen3-architecture causal LM randomly initialised from a config (no hub download)."""

from __future__ import annotations

import torch

__all__ = ["tiny_qwen3", "tiny_qwen3_moe"]


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
