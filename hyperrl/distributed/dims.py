"""The parallel dimensions of a run and the process group.

:class:`ParallelDims` is one value — world, data-parallel and tensor-parallel sizes, with room for
the expert (``ep``) and context (``cp``) axes — that says how the world is split and builds the
device mesh once (torchtitan's ``ParallelDims``). :func:`init_distributed` joins the process group
under ``torchrun``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from hyperrl.device import collective_backend, pick_device

__all__ = ["ParallelDims", "init_distributed", "world_size"]


def world_size() -> int:
    """The run's process count: the initialised process group's, else ``WORLD_SIZE`` (torchrun sets
    it before any group exists), else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class ParallelDims:
    """How the world's ranks are split: ``world = dp · tp · cp``; ``ep`` splits a mixture's experts over
    groups of ``ep`` data-parallel ranks at one TP coordinate (``ep`` consecutive ranks when ``tp = 1``;
    :meth:`expert_mesh`). ``tp`` consecutive ranks
    form a tensor-parallel group; ``cp`` ranks a context-parallel group (each holds a slice of every sequence of the
    group's rows; :mod:`hyperrl.distributed.context_parallel`, attention by ``cp_attention``): ``cp`` consecutive
    ranks, or with ``tp`` the ranks at one TP coordinate of a block of ``tp · cp`` consecutive ranks (which train
    the same rows); with ``ep``, an ``ep`` group pools the tokens of its ranks' slices;
    ``dp`` is the data-parallel size — the number of distinct row shares (FSDP2 shards parameters over
    every rank all the same). The rules (each size divides what it splits; what composes with what) are checked
    here, once — the config's checks build this value to check them at load. :meth:`mesh` builds the device mesh
    once and returns the same one after: a 1-D ``("fsdp",)`` mesh when ``tp == 1``, a 2-D ``("dp", "tp")`` mesh
    otherwise; :meth:`data_groups` the process groups the parallel strategy reduces over."""

    world: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    cp_attention: str = "ulysses"  # how attention runs over the cp ranks (hyperrl.distributed.context_parallel)

    def __post_init__(self):
        for name in ("world", "tp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel dims: {name}={getattr(self, name)} must be ≥ 1")
        if self.cp_attention not in ("ulysses", "ring"):
            raise ValueError(f"run.cp_attention={self.cp_attention!r}: ulysses or ring")
        if self.cp > 1 and self.tp > 1 and self.ep > 1:
            raise ValueError(f"run.cp={self.cp} with both run.tp={self.tp} and run.ep={self.ep}: context parallelism "
                             "composes with one of them at a time yet; drop one")
        if self.world % self.cp:
            raise ValueError(f"run.cp={self.cp} does not divide the world size {self.world} (torchrun "
                             "--nproc-per-node)")
        if self.world % self.tp:
            raise ValueError(f"run.tp={self.tp}: needs torchrun with a multiple of {self.tp} processes "
                             f"(WORLD_SIZE={self.world})")
        if self.cp > 1 and self.world % (self.cp * self.tp):
            raise ValueError(f"run.cp={self.cp} × run.tp={self.tp} = {self.cp * self.tp} ranks a block does not divide "
                             f"the world size {self.world} (torchrun --nproc-per-node)")
        if (self.world // self.tp) % self.ep:
            within = f"the data-parallel size {self.world // self.tp} (world {self.world} / run.tp={self.tp})" \
                if self.tp > 1 else f"the world size {self.world}"
            raise ValueError(f"run.ep={self.ep} does not divide {within} (torchrun --nproc-per-node)")
        object.__setattr__(self, "_meshes", {})

    @property
    def dp(self) -> int:
        """The data-parallel size ``world / (tp · cp)``: every rank trains its own rows under expert
        parallelism (the ``ep`` ranks of a group exchange tokens, not batches)."""
        return self.world // (self.tp * self.cp)

    @classmethod
    def from_config(cls, run) -> ParallelDims:
        """The dims of this process's world with every other size read from the config's ``run`` section
        (``run.tp``, ``run.ep``, ``run.cp``, …: a field of this class is a key there), so a new dimension is a field
        here and a key in the config — the composition root is not edited."""
        sizes = {f.name: getattr(run, f.name) for f in fields(cls) if f.name != "world"}
        return cls(world=world_size(), **sizes)

    @classmethod
    def from_env(cls, tp: int = 1, ep: int = 1, cp: int = 1) -> ParallelDims:
        """The dims of this process's world (:func:`world_size`) with tensor parallelism ``tp``, expert
        parallelism ``ep`` and context parallelism ``cp``."""
        return cls(world=world_size(), tp=tp, ep=ep, cp=cp)

    def expert_mesh(self, device_type: str):
        """The experts' device mesh: ``("replica", "ep")`` (``world / ep × ep``; ``ep`` consecutive ranks
        share a layer's experts; the ranks at one ``ep`` position hold the same ones), and with tensor
        parallelism ``("replica", "ep", "tp")`` (``dp / ep × ep × tp``: rank ``(g·ep + j)·tp + t`` — an
        ``ep`` group is ``ep`` data-parallel ranks at one TP coordinate ``t``; a TP group's ranks see the
        same tokens, so they hold the same experts)."""
        key = ("experts", device_type)
        if key not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = (self.world // self.tp // self.ep, self.ep), ("replica", "ep")
            if self.tp > 1:
                shape, names = (*shape, self.tp), (*names, "tp")
            self._meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return self._meshes[key]

    def data_groups(self) -> tuple:
        """``(data-parallel group, share group, TP group, CP group)`` of this rank — the share group: the ``tp · cp``
        consecutive ranks training the same rows; the TP / CP group that block when only one of them is > 1, else its
        ``tp`` consecutive ranks / its ranks at this TP coordinate; ``None`` where a size is 1 (``None, None`` first
        when ``tp · cp = 1``: the world is both) — created once on the initialised process group, every rank creating
        every group in the same order (torch.distributed's rule)."""
        if "groups" not in self._meshes:
            import torch.distributed as dist

            s, rank, dp, share = self.tp * self.cp, dist.get_rank(), None, None
            if s > 1:
                for t in range(s):
                    g = dist.new_group(list(range(t, self.world, s)))
                    dp = g if t == rank % s else dp
                for d in range(self.world // s):
                    g = dist.new_group(list(range(d * s, (d + 1) * s)))
                    share = g if d == rank // s else share
            tp_group, cp_group = (share if self.tp > 1 else None), (share if self.cp > 1 else None)
            if self.tp > 1 and self.cp > 1:  # a block of tp · cp ranks: TP groups consecutive, CP groups strided
                for d in range(self.world // s):
                    for c in range(self.cp):
                        g = dist.new_group(list(range(d * s + c * self.tp, d * s + (c + 1) * self.tp)))
                        tp_group = g if (d, c) == (rank // s, rank % s // self.tp) else tp_group
                    for t in range(self.tp):
                        g = dist.new_group(list(range(d * s + t, (d + 1) * s, self.tp)))
                        cp_group = g if (d, t) == (rank // s, rank % self.tp) else cp_group
            self._meshes["groups"] = (dp, share, tp_group, cp_group)
        return self._meshes["groups"]

    def mesh(self, device_type: str):
        """The run's device mesh on ``device_type`` (built on the first call, the same object after)."""
        if device_type not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            shape, names = ((self.world,), ("fsdp",)) if self.tp == 1 else ((self.world // self.tp, self.tp),
                                                                             ("dp", "tp"))  # FSDP2 over dp · cp
            self._meshes[device_type] = init_device_mesh(device_type, shape, mesh_dim_names=names)
        return self._meshes[device_type]


def init_distributed(device: str = "cpu") -> int:
    """Under ``torchrun`` (``WORLD_SIZE > 1``) join the process group — gloo on CPU, NCCL on CUDA,
    HCCL on NPU — and return this process's rank (0 when single-process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(collective_backend(pick_device(device)))
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
