"""LoRA through PEFT: the adapters train, the base stays frozen, and nothing is copied.

* :func:`apply_lora` wraps a causal LM with ``peft.get_peft_model`` (``model.lora`` in the config).
* The **reference** policy is the same model with its adapters disabled (:class:`AdapterDisabled`):
  no second copy of the base weights.
* **Publication** sends merged weights by their Hugging Face names (:class:`MergedView`):
  ``W + Σ_adapters ΔW`` computed functionally from PEFT's ``get_delta_weight`` (``ΔW = s·B A``) —
  never ``merge_adapter`` / ``unmerge_adapter`` in place, whose round trip leaves rounding drift in
  the base — through the engine's usual all-or-nothing transaction.
* **Checkpoints** hold the trainable parameters (the adapters) and their optimizer state only
  (:class:`TrainableView`); the base is rebuilt from ``model.checkpoint`` (or the seeded random
  init) on resume.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["apply_lora", "AdapterDisabled", "MergedView", "TrainableView", "is_lora", "trainable_parameters"]


def apply_lora(model: torch.nn.Module, *, r: int, alpha: int, dropout: float, target_modules: list[str],
               train_modules: list[str] = ()):
    """``model`` with LoRA adapters on ``target_modules`` (rank ``r``, scale ``alpha / r``); only the
    adapters — and the parameters of ``train_modules`` (full module paths such as ``model.norm``,
    trained in place, not copied) — require grad. PEFT initialises ``B = 0``, so the wrapped model
    starts equal to ``model``. A vision-language model gets adapters on its language model only (the
    vision tower frozen)."""
    import re

    from peft import LoraConfig, get_peft_model

    names = [n for n, _ in model.named_modules()]
    missing = sorted(t for t in target_modules if not any(n.split(".")[-1] == t for n in names))
    if missing:
        raise ValueError(f"model.lora.target_modules: {missing} name no module of this model")
    tied = getattr(model.config, "tie_word_embeddings", False)
    if tied and any(t in ("embed_tokens", "lm_head") for t in target_modules):
        raise ValueError("model.lora.target_modules: adapters on a tied embed_tokens / lm_head would publish an "
                         "embedding the engine ties to a different output layer; train it with "
                         "model.lora.train_modules: [model.embed_tokens] instead")
    unknown = sorted(set(train_modules) - set(names))
    if unknown:
        raise ValueError(f"model.lora.train_modules: {unknown} are not module paths of this model (e.g. model.norm)")
    targets = list(target_modules)
    if getattr(model.config, "vision_config", None) is not None:  # a vision-language model: the language model only
        # (its vision tower has modules of the same names — gate_proj … — which stay frozen); PEFT full-matches a
        # string against every module path
        targets = rf"(?:.*\.)?language_model\..*\.(?:{'|'.join(re.escape(t) for t in target_modules)})"
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                     bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    for path in train_modules:
        model.get_submodule(path).requires_grad_(True)
    return peft_model


def is_lora(model) -> bool:
    """Is ``model`` a PEFT model with adapters (one that can disable them)?"""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train (``requires_grad``): a LoRA model's adapters (and ``train_modules``), every weight
    otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


class AdapterDisabled(torch.nn.Module):
    """The base model of a PEFT model, run by disabling its adapters around each forward (the
    reference policy of a LoRA run: the same weights, no copy). Parameters trained in place besides
    the adapters (``train_modules``) are frozen here at their initial values — a copy of those
    only — and substituted with ``torch.func.functional_call`` (the policy is never mutated)."""

    def __init__(self, peft_model):
        super().__init__()
        self.inner = peft_model
        self._initial = {n: p.detach().clone() for n, p in peft_model.named_parameters()
                         if p.requires_grad and ".lora_" not in n}

    def forward(self, *args, **kwargs):
        with self.inner.disable_adapter():
            if not self._initial:
                return self.inner(*args, **kwargs)
            return torch.func.functional_call(self.inner, self._initial, args, kwargs, strict=False)


class MergedView:
    """What a publisher reads from a LoRA policy: ``named_parameters()`` → the merged weights under
    the base model's Hugging Face names (``…q_proj.weight``, not ``…q_proj.base_layer.weight``)."""

    def __init__(self, peft_model):
        from peft.tuners.lora import LoraLayer

        self.base = peft_model.get_base_model()
        self._lora = {n: m for n, m in self.base.named_modules() if isinstance(m, LoraLayer)}

    @torch.no_grad()
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.base.named_parameters():
            if ".lora_" in name:
                continue
            owner, sep, leaf = name.rpartition(".base_layer.")
            if not sep:
                yield name, p
                continue
            layer = self._lora.get(owner)
            if layer is not None and leaf == "weight":
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
                yield f"{owner}.{leaf}", p + delta.to(p.dtype)
            else:
                yield f"{owner}.{leaf}", p


class TrainableView:
    """A module seen through its trainable parameters only (what a LoRA checkpoint holds)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return {n: (p if keep_vars else p.detach()) for n, p in self.module.named_parameters() if p.requires_grad}
