"""Mixture-of-experts routers and routing replay — the producer and consumer of the trajectory's
``routed_experts`` key (:mod:`hyperrl.trajectory`), used by the rollout engines (capture) and the
trainer's forwards (replay, agreement): a foundation, so both may import it.

A router is a module with ``top_k`` and ``num_experts`` whose forward returns ``(logits [N, E],
weights [N, k], ids [N, k])`` — transformers' ``Qwen3MoeTopKRouter`` and its kin (``mlp.gate`` of
each sparse layer). :class:`Routing` hooks them per model call: the routes a rollout recorded for
that call's tokens (``[N, L, k]`` expert ids, −1 = none) are compared with the router's own choice
(the agreement metrics) and, with ``force``, used instead of it (R2 / R3); the routes a call used
are kept (the engine's capture, R2's record).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["moe_routers", "is_moe", "Routing", "RoutePlan", "replay_weights", "check_routes"]


def moe_routers(model) -> list[torch.nn.Module]:
    """The model's routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts")
            and isinstance(getattr(m, "weight", None), torch.nn.Parameter)]


def is_moe(model) -> bool:
    """Whether ``model`` has MoE routers (:func:`moe_routers`)."""
    return bool(moe_routers(model))


def replay_weights(logits: torch.Tensor, ids: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """The gate weights of forced experts ``ids [N, k]`` from the current router's ``logits [N, E]``:
    ``w = softmax(logits)[ids]`` (fp32), renormalised over the ``k`` when the family does
    (``norm_topk_prob``), in the logits' dtype — what the router computes for its own top-k, so
    the router keeps its gradient and replaying the router's own choice changes nothing."""
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
    if norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype)


class Routing:
    """Routing replay and capture over ``model``'s routers (see the module doc). Use::

        routing = Routing(model)
        with routing.call(routes, force=True):   # routes [N, L, k] for the N tokens of this call
            model(...)                           # exactly one forward
        routing.used          # [N, L, k] int16: the experts the call ran (forced or the router's)

    Entries ``< 0`` of ``routes`` (no recorded route) leave that token's routing to the router; the
    caller decides which tokens must have one (:func:`hyperrl.transforms.check_routes`). Counters for
    the agreement of the router's own top-k sets with ``routes`` accumulate over calls:
    ``agree [L]`` (tokens whose sets match) of ``counted`` (tokens with a route), and ``all_agree``
    (tokens matching on every layer); :meth:`reset` clears them."""

    def __init__(self, model):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("Routing: the model has no MoE router (a module with top_k and num_experts)")
        self.layers, self.top_k = len(self.routers), int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self.used: torch.Tensor | None = None
        self.reset()

    def reset(self) -> None:
        self.agree = torch.zeros(self.layers, dtype=torch.long)
        self.counted = torch.zeros((), dtype=torch.long)
        self.all_agree = torch.zeros((), dtype=torch.long)

    def metrics(self) -> dict[str, float]:
        """The agreement counted since :meth:`reset`: ``moe_route_agree_l{i}`` (the fraction of routed
        tokens whose top-k set in layer ``i`` equals the reference's), ``moe_route_agree`` (their
        mean) and ``moe_route_all_layers_agree`` (tokens matching on every layer); empty when no
        token had a reference route."""
        n = int(self.counted)
        if not n:
            return {}
        out = {f"moe_route_agree_l{i}": float(a) / n for i, a in enumerate(self.agree.tolist())}
        out["moe_route_agree"] = float(self.agree.sum()) / (n * self.layers)
        out["moe_route_all_layers_agree"] = float(self.all_agree) / n
        return out

    def call(self, routes: torch.Tensor | None = None, *, force: bool = False):
        """Context for one model call (see the class doc); ``routes=None``: capture only."""
        return _Call(self, routes, force)


class _Call:
    def __init__(self, routing: Routing, routes, force: bool):
        if routes is not None and (routes.dim() != 3 or tuple(routes.shape[1:]) != (routing.layers, routing.top_k)):
            raise ValueError(f"routed_experts: per-token routes [N, L={routing.layers}, k={routing.top_k}] expected, "
                             f"got {list(routes.shape)}")
        if force and routes is None:
            raise ValueError("Routing.call(force=True) needs the routes to force")
        self.r, self.routes, self.force, self.hooks = routing, routes, force, []
        self.used: list = [None] * routing.layers
        self.match: list = [None] * routing.layers

    def _hook(self, k: int):
        def hook(module, args, out):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError(f"routing replay: router {type(module).__name__} returns {type(out).__name__}, not "
                                "(logits, weights, ids); its family has no replay hook")
            logits, weights, ids = out
            used = ids
            if self.routes is not None:
                if self.routes.shape[0] != ids.shape[0]:
                    raise ValueError(f"routed_experts: {self.routes.shape[0]} token routes for a call routing "
                                     f"{ids.shape[0]} tokens")
                ref = self.routes[:, k].to(ids.device, torch.long)
                has = (ref >= 0).all(-1)
                same = (ids.sort(-1).values == ref.sort(-1).values).all(-1)
                self.match[k] = (same | ~has, has)
                if self.force:
                    used = torch.where(has[:, None], ref, ids)
                    weights = replay_weights(logits, used, bool(getattr(module, "norm_topk_prob", False)))
            self.used[k] = used.detach().to(torch.int16)
            return (logits, weights, used) if used is not ids else out
        return hook

    def __enter__(self):
        self.hooks = [r.register_forward_hook(self._hook(k)) for k, r in enumerate(self.r.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()
        if exc[0] is not None:
            return
        if any(u is None for u in self.used):
            raise RuntimeError("routing: a router did not run in this call (one model forward per Routing.call)")
        self.r.used = torch.stack(self.used, 1).cpu()  # [N, L, k]
        if self.routes is not None:
            has = self.match[0][1]
            same = torch.stack([m[0] & has for m in self.match])  # [L, N]
            self.r.agree += same.sum(-1).cpu()
            self.r.counted += int(has.sum())
            self.r.all_agree += int(same.all(0).sum())


def check_routes(batch, routing: Routing, key: str = "routed_experts", why: str = "") -> None:
    """``batch[key]`` fits the model's routers: present, ``[B, T, L, k]`` with the model's ``L`` MoE
    layers and top-``k``, expert ids ``< E``, and a route (≥ 0) on every token before each row's last
    action token (the tokens whose routing reaches a trained log-prob; those after it — a trailing
    observation, the last token, padding — may have none). Raises ``ValueError`` naming the key, the
    value and the fix; ``why`` says who needs the routes."""
    if key not in batch.keys():
        raise ValueError(f"{key}: missing from the batch{why} — the transformers engine records it for an MoE "
                         "policy; multi-turn environments and agents do not carry it yet")
    r, (B, Tn) = batch[key], batch["tokens"].shape
    want = (B, Tn, routing.layers, routing.top_k)
    if tuple(r.shape) != want:
        raise ValueError(f"{key}: shape {list(r.shape)}, expected [B={B}, T={Tn}, L={routing.layers}, "
                         f"k={routing.top_k}] (the policy's MoE layers and experts per token){why}")
    if bool((r >= routing.num_experts).any()):
        b, t, layer, _ = (r >= routing.num_experts).nonzero()[0].tolist()
        raise ValueError(f"{key}: expert id {int(r[b, t, layer].max())} at token [{b}, {t}] layer {layer}; the policy "
                         f"has {routing.num_experts} experts (ids 0…{routing.num_experts - 1}){why}")
    act = batch["action_mask"].bool()
    pos = torch.arange(Tn, device=act.device)[None, :]
    last_action = torch.where(act, pos, -1).amax(-1, keepdim=True)
    missing = (pos < last_action) & (r < 0).flatten(2).any(-1)
    if bool(missing.any()):
        b, t = missing.nonzero()[0].tolist()
        raise ValueError(f"{key}: token [{b}, {t}] has no route (−1) but a trained log-prob depends on it{why}; "
                         "replay never falls back to the model's own routing — record routes for every token before "
                         "a row's last action")


@dataclass(frozen=True)
class RoutePlan:
    """Which routes each trainer forward of a mixture of experts uses, from ``algo.routing_replay`` (the one place
    its mode is read; docs/moe.md): ``r3`` — every forward (old, reference, update) replays the rollout's
    ``routed_experts``; ``r2`` — the update replays the routes of the trainer's own old pass
    (``old_routed_experts``); ``none`` — each router chooses, its agreement with the rollout's routes measured.
    ``routing``: the policy's :class:`Routing`; ``reference``: the reference's (or None); ``single_pass``: no
    old pass runs (the update's forward measures the agreement). Each method returns the ``routes`` argument of
    the trainer's forward, ``(routing, key | None, force)``."""

    routing: Routing
    reference_routing: Routing | None
    mode: str  # none | r2 | r3
    single_pass: bool = False

    def __post_init__(self):
        if self.mode not in ("none", "r2", "r3"):
            raise ValueError(f"algo.routing_replay={self.mode!r}: expected none, r2 or r3")

    @property
    def replays_old(self) -> bool:
        """R2: the old pass keeps the routes it used (``old_routed_experts``) for the update to replay."""
        return self.mode == "r2"

    def _key(self, batch) -> str | None:
        return None if self.mode == "none" and "routed_experts" not in batch.keys() else "routed_experts"

    def check(self, batch) -> None:
        """The rollout's routes fit the policy (:func:`check_routes`) whenever they are replayed or present."""
        if self._key(batch) is not None:
            check_routes(batch, self.routing, why=f" (algo.routing_replay={self.mode})" if self.mode != "none"
                         else "")

    def old(self, batch) -> tuple:
        """The old pass: R3 replays the rollout's routes; otherwise the router's own, compared with them."""
        return self.routing, self._key(batch), self.mode == "r3"

    def update(self, batch) -> tuple:
        """The update's forward: R3 replays the rollout's routes, R2 the old pass's; otherwise the rollout's are
        compared with (single pass only: the old pass measured them already)."""
        if self.mode == "r3":
            return self.routing, "routed_experts", True
        if self.mode == "r2":
            return self.routing, "old_routed_experts", True
        return self.routing, ("routed_experts" if self.single_pass and "routed_experts" in batch.keys() else None), \
            False

    def reference(self, batch) -> tuple | None:
        """The reference's forward: under R3 (and an MoE reference) the rollout's routes, else its own routing."""
        if self.mode == "r3" and self.reference_routing is not None:
            return self.reference_routing, self._key(batch), True
        return None
