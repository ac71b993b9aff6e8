"""Mixture-of-experts router terms: the load-balancing auxiliary loss and the router's metrics.

Kernels over the router logits a forward produced — one ``[N, E]`` tensor per MoE layer (``N``
tokens, ``E`` experts) — and a token mask ``[N]`` (real tokens 1, padding 0). Pure; the policy's
routers are tapped by :class:`hyperrl.models.moe.RouterTap`.
"""

from __future__ import annotations

import torch

from hyperrl.transforms.loss import LossOutput

__all__ = ["load_balancing_loss", "router_metrics", "router_loss"]


def _check(logits: list[torch.Tensor], mask: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """The layers' logits stacked ``[L, N, E]`` after checking shapes, ``top_k`` and the mask."""
    if not logits:
        raise ValueError("router logits: no MoE layer ran (is the policy a mixture of experts?)")
    shapes = {tuple(x.shape) for x in logits}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"router logits: every layer [N, E], the same shape; got {sorted(shapes)}")
    n, e = next(iter(shapes))
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k}: must be in 1..{e} (the experts)")
    if mask is not None and tuple(mask.shape) != (n,):
        raise ValueError(f"router token mask: shape {tuple(mask.shape)}, expected [{n}] (the tokens routed)")
    return torch.stack(logits)


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss as Qwen3-MoE / Mixtral compute it (Fedus et al.,
    2021, eqs. 4–6), pooled over the layers' real tokens::

        aux = E · Σ_e f_e · P_e,   f_e = (1/N') Σ_{l,t} 1[e ∈ top_k(p_{l,t})],   P_e = (1/N') Σ_{l,t} p_{l,t,e}

    with ``p = softmax(logits)`` and ``N'`` the real (layer, token) pairs. Perfectly balanced
    routing gives ``top_k``; all tokens on the same k experts give ``E``. Differentiable through
    ``P`` (``f`` is a count). ``logits``: ``[N, E]`` per layer; ``mask``: ``[N]``."""
    x = _check(logits, mask, top_k)
    probs = torch.softmax(x.float(), dim=-1)  # [L, N, E]
    chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0)
    w = torch.ones(x.shape[:2], device=x.device) if mask is None else mask.float()[None].expand(x.shape[:2])
    total = w.sum().clamp_min(1.0)
    f = (chosen * w[..., None]).sum((0, 1)) / total
    p = (probs * w[..., None]).sum((0, 1)) / total
    return x.shape[-1] * (f * p).sum()


def router_metrics(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Detached per-layer router diagnostics over the real tokens: ``moe_load_max_l{i}`` — the
    busiest expert's share of the layer's routed (token, slot) pairs over the mean share ``1/E``
    (1 = balanced, ``E/k`` = every token on the same experts); ``moe_router_entropy_l{i}`` — the
    mean entropy of the router's softmax (nats; ``log E`` = uniform); and their means over layers
    (``moe_load_max``, ``moe_router_entropy``)."""
    x = _check([t.detach() for t in logits], mask, top_k).float()
    w = torch.ones(x.shape[1], device=x.device) if mask is None else mask.float()
    probs = torch.softmax(x, dim=-1)
    counts = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0)
    share = (counts * w[None, :, None]).sum(1) / (w.sum() * top_k).clamp_min(1.0)  # [L, E], rows sum to 1
    load = share.max(-1).values * x.shape[-1]
    ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    ent = (ent * w[None]).sum(1) / w.sum().clamp_min(1.0)
    out = {f"moe_load_max_l{i}": load[i] for i in range(len(load))}
    out.update({f"moe_router_entropy_l{i}": ent[i] for i in range(len(ent))})
    out["moe_load_max"], out["moe_router_entropy"] = load.mean(), ent.mean()
    return out


def router_loss(logits: list[torch.Tensor], top_k: int, coef: float, mask: torch.Tensor | None = None) -> LossOutput:
    """``loss_router_aux = coef · load_balancing_loss`` (a term the caller sums; none at ``coef`` 0)
    plus :func:`router_metrics` and the unscaled ``moe_aux_loss``."""
    if coef < 0:
        raise ValueError(f"router_aux_loss_coef={coef}: must be ≥ 0")
    aux = load_balancing_loss(logits, top_k, mask)
    terms = {"loss_router_aux": coef * aux} if coef > 0 else {}
    return LossOutput(terms, {"moe_aux_loss": aux.detach(), **router_metrics(logits, top_k, mask)})
