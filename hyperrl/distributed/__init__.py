"""Parallelism in one place: the run's parallel dimensions, their rules, device meshes and process groups
(:mod:`.dims`), the parallelize plan of each model family (:mod:`.parallelize`, a registry), and the parallel
strategy that owns every collective of the loop (:mod:`.strategy`)."""

from hyperrl.distributed.dims import ParallelDims, init_distributed, world_size
from hyperrl.distributed.strategy import LocalParallel, TorchDataParallel, TorchParallel, make_parallel

__all__ = ["ParallelDims", "init_distributed", "world_size", "LocalParallel", "TorchParallel", "TorchDataParallel",
           "make_parallel"]
