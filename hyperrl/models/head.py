"""An fp32 LM head: the last projection computed in fp32 whatever the rest of the model runs in.

A bf16 LM head rounds every logit to 8 mantissa bits — at logits of magnitude ~10 that is ~0.04 nats per
token before the log-softmax, and the trainer (autocast, fp32 master weights) and a bf16 rollout engine
round differently, so their log-probs of the same token drift apart (open-instruct PR #1387 reports
2–24+ nats on some tokens); prime-rl (#2438) and NeMo-RL (#3936) compute the head in fp32.
:func:`fp32_lm_head` makes a Hugging Face causal LM do the same: its output projection runs with autocast
off on fp32 copies of its input and weight, so the logits (and the log-softmax hyperrl's transforms take
of them, fp32 already) are fp32 products — in the trainer's forwards and in every engine built from a copy
of the patched model. The weights stay where they are (the trainer's fp32 masters; a bf16 engine's bf16
copy, upcast per call); the cost is the ``[B, T, V]`` logits in fp32 instead of the compute dtype.
"""

from __future__ import annotations

import types

import torch

__all__ = ["fp32_lm_head", "has_fp32_lm_head"]


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(device_type=x.device.type, enabled=False):
        w = self.weight
        b = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), w.float(), b)


def fp32_lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """Compute ``model``'s output projection (``get_output_embeddings()``, a ``Linear``) in fp32, in place;
    a deep copy of the model keeps it (the bound forward is copied with its module)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"model.lm_head_fp32: {type(model).__name__}'s output projection is a "
                         f"{type(head).__name__}, not a Linear layer; set model.lm_head_fp32=false")
    head.forward = types.MethodType(_forward, head)
    head._hyperrl_fp32 = True
    return model


def has_fp32_lm_head(model: torch.nn.Module) -> bool:
    """Whether :func:`fp32_lm_head` was applied to ``model`` (or the model it was copied from)."""
    return bool(getattr(model.get_output_embeddings(), "_hyperrl_fp32", False))
