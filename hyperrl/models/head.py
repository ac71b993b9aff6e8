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

import contextlib
import types
import warnings
from dataclasses import dataclass

import torch

from hyperrl.multimodal import output_mask

__all__ = ["fp32_lm_head", "has_fp32_lm_head", "fusable_head", "head_skipped", "head_weights", "HeadWeights",
           "use_fused_head", "FUSED_HEAD_FAMILIES", "FUSED_HEAD_AUTO_VOCAB"]

# model types whose causal-LM forward applies nothing after the head but the head itself (no logit soft-capping as
# Gemma's, no logit scale as Cohere's or Granite's): the head's input is all the log-probs need
FUSED_HEAD_FAMILIES = frozenset({"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "qwen2_vl", "qwen2_5_vl", "llama",
                                 "mistral", "mixtral"})
FUSED_HEAD_AUTO_VOCAB = 8192  # optim.fused_head: auto fuses from this vocabulary on


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


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a PEFT wrapper (``PeftModel.base_model.model``), else ``model``."""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if inner is not None and type(model).__name__.startswith("Peft") else model


def _masks(head: torch.nn.Module) -> list | None:
    """The head's forward hooks as ``(ids, value)`` output masks (:func:`hyperrl.multimodal.suppress_outputs`);
    None when one is anything else."""
    masks = [output_mask(h) for h in head._forward_hooks.values()]
    return None if any(m is None for m in masks) else masks


def fusable_head(model: torch.nn.Module) -> str | None:
    """Why the trainer cannot skip ``model``'s head and fuse it with the log-prob (None: it can) — the head is not
    a plain ``Linear`` (a LoRA-wrapped head), the family may transform the logits after it, or a hook on the head
    does something other than mask outputs."""
    lm = _causal_lm(model)
    kind = getattr(getattr(lm, "config", None), "model_type", None)
    if kind not in FUSED_HEAD_FAMILIES:
        return (f"model type {kind!r} is not one whose logits are its head's output alone "
                f"({sorted(FUSED_HEAD_FAMILIES)})")
    get = getattr(lm, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not torch.nn.Linear:
        return f"its output projection is a {type(head).__name__}, not a Linear layer"
    if head._forward_pre_hooks or _masks(head) is None:
        return "its output projection has a hook that is not an output mask (hyperrl.multimodal.suppress_outputs)"
    return None


@contextlib.contextmanager
def head_skipped(model: torch.nn.Module):
    """Within: ``model(...).logits`` are the hidden states its head reads (``[..., H]``), the head and its output
    masks not run (:func:`head_weights` hands the masks to the fused kernel)."""
    head = _causal_lm(model).get_output_embeddings()
    own = head.__dict__.get("forward")  # the fp32 head's bound forward, or None (the class's)
    hooks = head._forward_hooks
    head.forward, head._forward_hooks = _identity, type(hooks)()
    try:
        yield
    finally:
        head._forward_hooks = hooks
        if own is None:
            del head.forward
        else:
            head.forward = own


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class HeadWeights:
    """What the fused head needs of a model's head: ``weight [V, H]``, ``bias [V]`` or None, the matmul's
    ``dtype`` (fp32 for an fp32 head, :func:`fp32_lm_head`; None: the autocast dtype, as the head would run), and
    its output ``masks`` (``(ids, value)`` pairs, :func:`hyperrl.multimodal.suppress_outputs`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype | None
    masks: tuple


def head_weights(model: torch.nn.Module) -> HeadWeights:
    """``model``'s head as the fused kernel takes it (:class:`HeadWeights`)."""
    head = _causal_lm(model).get_output_embeddings()
    masks = _masks(head)
    if masks is None:
        raise ValueError(f"{type(model).__name__}'s output projection has a forward hook that is not an output mask: "
                         "the fused head would skip it (run it unfused: optim.fused_head=off)")
    return HeadWeights(head.weight, head.bias, torch.float32 if has_fp32_lm_head(model) else None, tuple(masks))


def use_fused_head(mode: str, model: torch.nn.Module) -> bool:
    """``optim.fused_head`` (``on`` | ``auto`` | ``off``) for ``model``: whether its forwards fuse the head with the
    log-prob — never where :func:`fusable_head` objects; ``auto`` from :data:`FUSED_HEAD_AUTO_VOCAB` tokens on."""
    why = None if mode == "off" else fusable_head(model)
    if mode == "on" and why is not None:  # asked for by name: say why it cannot be (once per place and reason)
        warnings.warn(f"optim.fused_head=on: {type(model).__name__} runs its head unfused — {why}", RuntimeWarning,
                      stacklevel=2)
    if mode == "off" or why is not None:
        return False
    return mode == "on" or _causal_lm(model).get_output_embeddings().weight.shape[0] >= FUSED_HEAD_AUTO_VOCAB
