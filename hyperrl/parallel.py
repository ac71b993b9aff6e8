"""The data-parallel strategy: every collective and lockstep rule of the loop, in one object.

FSDP2 needs every rank to make the same model calls in the same order. The rules that keep
ranks in step — and the reductions that make data-parallel training exact — live here, not in
the loop:

* the **global normaliser**: token / sequence counts of an optimizer step summed over ranks,
  so summed per-micro-batch losses equal the full-batch loss (:mod:`hyperrl.transforms.aggregation`);
* **micro-batch count agreement**: ranks with fewer micro-batches run zero-weight passes;
* **forward-path agreement**: the shared-prefix forward only if every rank prefers it, the
  continuation call if any rank needs it;
* **row agreement**: a step is skipped on every rank when any rank has no rows;
* **loss scale**: FSDP averages gradients over ranks, so each loss is multiplied by the world size
  to give the sum the global normaliser expects (gloo has no PREMUL_SUM for a factor of 1);
* **replicated modules** (a LoRA policy's frozen base is not sharded): parameters broadcast from
  rank 0 at setup, plain (non-DTensor) gradients all-reduced before clipping;
* **gradient norm** over sharded (DTensor) gradients; **metric reduction** (mean over the ranks
  that report a key).

:class:`LocalParallel` is the identity (one process); :class:`TorchDataParallel` runs the
rules on an initialised ``torch.distributed`` process group (gloo, NCCL, HCCL).
"""

from __future__ import annotations

import torch

from . import transforms as T

__all__ = ["LocalParallel", "TorchDataParallel", "make_parallel"]


class LocalParallel:
    """One process: every rule is the identity."""

    rank, world = 0, 1

    @property
    def loss_scale(self) -> float:
        return float(self.world)

    def shard(self, items: list) -> list:
        """This rank's share of a global list (round-robin)."""
        return items[self.rank::self.world]

    def all_have_rows(self, n: int) -> bool:
        return n > 0

    def global_normalizer(self, norm: T.Normalizer) -> T.Normalizer:
        return norm

    def pad_micro_batches(self, micros: list) -> list:
        """``micros`` padded with ``None`` (zero-weight passes) to the largest count over ranks."""
        return micros

    def agree_forward(self):
        """A function ``(use_shared, S) -> (use_shared, S)`` agreeing the forward path, or None."""
        return None

    def replicate(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with the same parameters and buffers on every rank (rank 0's)."""
        return module

    def sync_grads(self, params) -> None:
        """Reduce the gradients of replicated (non-DTensor) ``params`` over ranks."""

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """Clip the gradients of ``params`` to a global norm; returns the norm before clipping."""
        gn = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
        return float(gn)

    def mean_metrics(self, metrics: dict) -> dict:
        return metrics

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Numbers summed over ranks (a key some ranks lack counts as 0 there)."""
        return dict(sums)

    def barrier(self) -> None:
        pass


class TorchDataParallel(LocalParallel):
    """The rules on the default ``torch.distributed`` process group."""

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _reduce(self, values: list, op):
        t = torch.tensor(values)
        self._dist.all_reduce(t, op=op)
        return t

    def all_have_rows(self, n: int) -> bool:
        return int(self._reduce([n], self._dist.ReduceOp.MIN)[0]) > 0

    def global_normalizer(self, norm: T.Normalizer) -> T.Normalizer:
        t = self._reduce([float(norm.num_tokens), float(norm.num_seqs)], self._dist.ReduceOp.SUM)
        return T.Normalizer(t[0], t[1], norm.length_const)

    def pad_micro_batches(self, micros: list) -> list:
        most = int(self._reduce([len(micros)], self._dist.ReduceOp.MAX)[0])
        return micros + [None] * (most - len(micros))

    def agree_forward(self):
        def agree(use: bool, S: int) -> tuple[bool, int]:
            t = self._reduce([int(not use), S], self._dist.ReduceOp.MAX)
            return not bool(t[0]), int(t[1])

        return agree

    @torch.no_grad()
    def replicate(self, module: torch.nn.Module) -> torch.nn.Module:
        for t in [*module.parameters(), *module.buffers()]:
            self._dist.broadcast(t.data, src=0)
        return module

    @torch.no_grad()
    def sync_grads(self, params) -> None:
        """Σ over ranks ÷ world of each replicated gradient, in one coalesced all-reduce. Each rank's
        loss carries ``loss_scale = world`` (what FSDP's average needs), so the result is the sum of
        the ranks' gradients under the global normaliser — the same gradient FSDP computes. DTensor
        gradients (FSDP already reduced them) are left alone. Our own rather than DDP: DDP wraps the
        module (renaming every parameter and owning the forward), and a few MB of adapters need no
        bucketing or overlap."""
        from torch.distributed.tensor import DTensor

        ps = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
        if not ps:
            return
        for p in ps:  # a parameter unused on this rank still joins the sum (with zeros)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).float() for p in ps])
        self._dist.all_reduce(flat)
        flat /= self.world
        for p, g in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p.grad))

    def clip_grad_norm(self, params, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        gn = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
        return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)

    def mean_metrics(self, metrics: dict) -> dict:
        """Numeric metrics averaged over ranks (a key some ranks lack averages over those that have it)."""
        mine = {k: float(v) for k, v in metrics.items()
                if isinstance(v, int | float) and k not in ("step", "policy_version")}
        names: list = [None] * self.world
        self._dist.all_gather_object(names, sorted(mine))
        keys = sorted(set().union(*names))
        t = torch.tensor([[mine.get(k, 0.0), float(k in mine)] for k in keys], dtype=torch.float64)
        self._dist.all_reduce(t)
        return {**metrics, **{k: s / c for k, (s, c) in zip(keys, t.tolist()) if c}}

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        names: list = [None] * self.world
        self._dist.all_gather_object(names, sorted(sums))
        keys = sorted(set().union(*names))
        t = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64)
        self._dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def barrier(self) -> None:
        self._dist.barrier()


def make_parallel() -> LocalParallel:
    """:class:`TorchDataParallel` under an initialised process group of > 1 rank, else :class:`LocalParallel`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDataParallel()
    return LocalParallel()
