"""What every policy forward shares: a model call (its mixture-of-experts routing captured or replayed —
:class:`RouteReplay` — and, for the fused log-probs, its head skipped), the token log-probs and entropies read from
its output, and a vision-language model's extra inputs. The forwards themselves are :mod:`hyperrl.loop.forward`'s
(plain, packed, context-parallel) and :mod:`hyperrl.loop.shared_prefix`'s.
"""

from __future__ import annotations

import contextlib

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.models.head import head_skipped, head_weights
from hyperrl.multimodal import VisionError, forward_inputs, row_patches, vision_spec

__all__ = ["RouteReplay", "route_call", "head_out", "lp_ent", "vision_inputs", "text_only", "first_action"]


class RouteReplay:
    """A mixture-of-experts forward's routing over a batch ``[B, T]`` (docs/moe.md): ``routes``
    ``[B, T, L, k]`` — the reference each call's tokens are compared with (the agreement counters of
    ``routing``, a :class:`hyperrl.models.Routing`) and, with ``force``, routed by; ``None`` captures
    only. After the pass ``captured [B, T, L, k]`` (int16) holds the experts every token ran (−1
    where no call ran it: a row's last token, padding). The forwards (:mod:`hyperrl.loop.forward`,
    :mod:`hyperrl.loop.shared_prefix`) map each model call's
    ``N`` tokens to batch positions with ``src [B, T]`` (the call's token index, −1 = not in it); a call over a
    context-parallel ``group`` (each rank a slice of the sequence) merges the ranks' captures and agreement counts
    afterwards, so every rank holds the whole batch's."""

    def __init__(self, routing, batch: TensorDict, routes: torch.Tensor | None = None, force: bool = False):
        B, Tn = batch["tokens"].shape
        self.routing, self.routes, self.force = routing, routes, force
        self.captured = torch.full((B, Tn, routing.layers, routing.top_k), -1, dtype=torch.int16)

    @contextlib.contextmanager
    def call(self, src: torch.Tensor, n: int, group=None):
        valid = src >= 0
        ref = None
        if self.routes is not None:
            ref = torch.full((n, self.routing.layers, self.routing.top_k), -1, dtype=torch.int16)
            ref[src[valid].cpu()] = self.routes[valid].to("cpu", torch.int16)  # a shared prompt: its rows agree
        counts = self._counts()
        with self.routing.call(ref, force=self.force):
            yield
        self.captured[valid.cpu()] = self.routing.used[src[valid].cpu()]
        if group is not None:
            self._merge(group, counts)

    def _counts(self) -> torch.Tensor:
        r = self.routing
        return torch.cat([r.agree, r.counted[None], r.all_agree[None]])

    def _merge(self, group, before: torch.Tensor) -> None:
        """The cp ranks' slices merged: each position was captured by one rank (−1 on the others: the max), the
        agreement counts this call added summed — one all-reduce each."""
        import torch.distributed as dist

        captured = self.captured.int()
        dist.all_reduce(captured, op=dist.ReduceOp.MAX, group=group)
        self.captured = captured.to(torch.int16)
        added = self._counts() - before
        dist.all_reduce(added, group=group)
        now, r = before + added, self.routing
        r.agree, r.counted, r.all_agree = now[:-2], now[-2], now[-1]


def route_call(replay: RouteReplay | None, src: torch.Tensor, n: int, group=None):
    """The context of one model call: ``replay.call(src, n, group)`` (:meth:`RouteReplay.call`), or none without
    routing replay."""
    return contextlib.nullcontext() if replay is None else replay.call(src, n, group)


def head_out(model, fused: bool, **kw):
    """``model(**kw)``; ``fused``: its head skipped — ``.logits`` are the hidden states the head reads."""
    if not fused:
        return model(**kw)
    with head_skipped(model):
        return model(**kw)


def lp_ent(model, x: torch.Tensor, targets: torch.Tensor, temperature: float, fused: bool):
    """Token log-probs and entropies of ``targets`` from ``x``: the logits ``[..., V]``, or — ``fused`` — the hidden
    states ``[..., H]`` through the head chunk by chunk (:func:`hyperrl.transforms.head_logprobs_and_entropy`)."""
    if not fused:
        return T.logprobs_and_entropy(x, targets, temperature)
    hw = head_weights(model)
    return T.head_logprobs_and_entropy(x, hw.weight, targets, temperature, bias=hw.bias, compute_dtype=hw.dtype,
                                       masks=hw.masks)


def vision_inputs(model, batch: TensorDict, ids: torch.Tensor, attn: torch.Tensor, rows=None) -> dict:
    """A vision-language model's extra inputs for ``ids [B', T']`` (``batch``'s rows ``rows``, all when None): the
    rows' images and M-RoPE ``position_ids [3, B', T']`` (:func:`hyperrl.multimodal.forward_inputs` — the rollout
    engine's prefill computes them the same way); ``{}`` for a text model (a batch with images then is an error)."""
    spec = vision_spec(model)
    has = "image_grid_thw" in batch.keys()
    if spec is None:
        if has and bool(row_patches(batch["image_grid_thw"]).any()):
            raise VisionError(f"image_grid_thw: the batch has images but {type(model).__name__} is a text-only model; "
                              "train a vision-language model (model.vision) or drop the images")
        return {}
    vis = None
    if has:
        vis = {k: batch[k] if rows is None else batch[k][rows] for k in ("pixel_values", "image_grid_thw")}
    return forward_inputs(model, spec, ids, attn.long(), vis)


def text_only(batch: TensorDict, model, who: str, fix: str) -> None:
    """Refuse a forward that does not carry images for a vision-language model."""
    if vision_spec(model) is not None:
        raise VisionError(f"{who} does not run vision-language models yet ({type(model).__name__}); {fix}")


def first_action(act: torch.Tensor) -> int:
    """The batch's first action position (≥ 1: position 0 predicts nothing); ``act`` has an action."""
    return max(int(act.int().argmax(-1)[act.any(-1)].min()), 1)
