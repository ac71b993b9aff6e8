"""A tiny Qwen3-architecture causal LM randomly initialised from a config (no hub download)."""

from __future__ import annotations

import torch

__all__ = ["tiny_qwen3"]


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
