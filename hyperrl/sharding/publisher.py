"""The publisher: owns the reshard plan from a trainer's parameters to an engine, and its execution.

``Publisher(model, engine, rank=, world=)`` reads the source layout from the model's parameters
(FSDP2 DTensor placements → specs on an ``fsdp`` mesh of ``world`` ranks; plain tensors are
replicated) and plans into the destination layout (today every rank's engine holds a full
replica: ``plain_destination``). ``publish(model, version)`` executes the plan — in one process
the identity plan's whole-tensor views are handed over without a copy; across processes the
direct-reshard executor moves exactly the planned slices — and hands the result to
``engine.load_weights(…, version)``, whose staging makes publication all-or-nothing. The
destination is the seam where an engine's own layout (``engine.layout()``) plugs in.
"""

from __future__ import annotations

import torch

from .dtensor import from_placements, is_dtensor, local
from .execute import execute_direct
from .layout import Layout, Placement, plain_destination
from .mesh import Mesh
from .plan import reshard_plan
from .spec import Spec

__all__ = ["Publisher", "source_layout"]


def source_layout(model: torch.nn.Module, world: int) -> Layout:
    """Each parameter's global shape, dtype and spec on ``Mesh.of(fsdp=world)``."""
    mesh = Mesh.of(fsdp=world)
    out = {}
    for k, p in model.named_parameters():
        spec = from_placements(p.placements, mesh, p.dim()) if is_dtensor(p) else Spec.replicate(p.dim())
        out[k] = Placement(tuple(p.shape), p.dtype, spec, mesh)
    return Layout(out)


class Publisher:
    def __init__(self, model: torch.nn.Module, engine, *, rank: int = 0, world: int = 1, destination=None):
        self.engine, self.rank, self.world = engine, rank, world
        src = source_layout(model, world)
        dst = destination or plain_destination(
            {k: (pl.shape, pl.dtype, Spec.replicate(len(pl.shape))) for k, pl in src.items()},
            Mesh.of(dp=world))
        self.plan = reshard_plan(src, dst)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's destination tensors, by engine parameter name."""
        shards = {k: local(p).detach() for k, p in model.named_parameters()}
        if self.world == 1:  # the identity plan: each transfer is a whole tensor — pass views, copy nothing
            out = {}
            for t in self.plan:
                view = shards[t.tensor][t.src_slice.slices()]
                if tuple(view.shape) != tuple(shards[t.tensor].shape):
                    raise RuntimeError(f"{t.param}: a one-process plan must move whole tensors, got {t.src_slice}")
                out[t.param] = view
            return out
        out = {k: torch.empty(tuple(p.shape), dtype=p.dtype) for k, p in model.named_parameters()}
        execute_direct(self.plan, self.rank, shards, out)
        return out

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Publish ``model`` as ``version`` (all-or-nothing: a refused publication raises
        ``WeightPublishError`` and the engine keeps serving its version)."""
        self.engine.load_weights(self.gather(model), version=version)
