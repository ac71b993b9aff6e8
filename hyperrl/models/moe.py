"""A mixture-of-experts policy's routers: finding them, and tapping the logits a forward routes by.

A router is a module with ``top_k`` and ``num_experts`` whose forward returns the router logits
``[N, E]`` first (transformers' ``Qwen3MoeTopKRouter`` and its kin: ``mlp.gate`` of each sparse
layer). :class:`RouterTap` hooks them for the span of a ``with`` block and keeps, per layer, the
logits of every forward run in it — with the mask of which of those ``N`` tokens are real, read
from the call's ``attention_mask`` (its last ``input_ids.shape[1]`` columns: the queries; a call
without one — the packed forward — has no padding).

Routing replay and capture (:class:`Routing`) live in :mod:`hyperrl.routing` (a foundation the
rollout engines import too) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperrl.routing import Routing, check_routes, is_moe, moe_routers, replay_weights

__all__ = ["moe_routers", "is_moe", "RouterTap", "TappedRouters", "Routing", "replay_weights", "check_routes"]


@dataclass(frozen=True)
class TappedRouters:
    """What a :class:`RouterTap` recorded, as values: every router's logits ``[N, E]``, the tokens' ``mask`` ``[N]``
    (or None), ``top_k`` and ``num_experts`` — e.g. gathered over the context-parallel ranks
    (:meth:`RouterTap.snapshot`)."""

    logits: list
    mask: torch.Tensor | None
    top_k: int
    num_experts: int


class RouterTap:
    """``with RouterTap(model) as tap: model(...)`` → ``tap.logits`` (one ``[N, E]`` per router,
    the calls concatenated), ``tap.mask`` (``[N]`` bool), ``tap.top_k``, ``tap.num_experts``.
    Hooks are removed on exit (a backward after it — gradient checkpointing's recompute — records
    nothing)."""

    def __init__(self, model):
        self.model, self.routers = model, moe_routers(model)
        if not self.routers:
            raise ValueError("RouterTap: the model has no MoE router (a module with top_k and num_experts)")
        self.top_k, self.num_experts = int(self.routers[0].top_k), int(self.routers[0].num_experts)
        self._calls: list[tuple[list[torch.Tensor | None], torch.Tensor | None]] = []
        self._hooks: list = []

    def __enter__(self) -> RouterTap:
        def on_call(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            am = kwargs.get("attention_mask")
            mask = None
            if am is not None and ids is not None:
                mask = am[:, -ids.shape[1]:].reshape(-1).bool()
            self._calls.append(([None] * len(self.routers), mask))

        def on_route(k):
            def hook(module, args, out):
                if self._calls:
                    self._calls[-1][0][k] = out[0] if isinstance(out, tuple) else out
            return hook

        self._hooks.append(self.model.register_forward_pre_hook(on_call, with_kwargs=True))
        self._hooks += [r.register_forward_hook(on_route(k)) for k, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @property
    def logits(self) -> list[torch.Tensor]:
        calls = [c for c in self._calls if all(x is not None for x in c[0])]
        return [torch.cat([c[0][k] for c in calls]) for k in range(len(self.routers))] if calls else []

    @property
    def mask(self) -> torch.Tensor | None:
        calls = [c for c in self._calls if all(x is not None for x in c[0])]
        if not calls or all(m is None for _, m in calls):
            return None
        return torch.cat([m if m is not None else torch.ones(x[0].shape[0], dtype=torch.bool, device=x[0].device)
                          for x, m in calls])

    def snapshot(self, gather=None) -> TappedRouters:
        """The tapped logits and mask as a :class:`TappedRouters`, each passed through ``gather`` (``[N, …] → [M,
        …]``, differentiable — e.g. the context-parallel ranks' tokens concatenated) when given."""
        logits, mask = self.logits, self.mask
        if gather is not None:
            logits = [gather(x) for x in logits]
            mask = None if mask is None else gather(mask.to(torch.uint8)).bool()
        return TappedRouters(logits, mask, self.top_k, self.num_experts)
