"""Parallelism in one place: the run's parallel dimensions and device mesh (:mod:`.dims`), the
parallelize plan of each model family (:mod:`.parallelize`, a registry), and the data-parallel
strategy that owns every collective of the loop (:mod:`.data_parallel`)."""

from hyperrl.distributed.data_parallel import LocalParallel, TorchDataParallel, make_parallel
from hyperrl.distributed.dims import ParallelDims, init_distributed, world_size

__all__ = ["ParallelDims", "init_distributed", "world_size", "LocalParallel", "TorchDataParallel", "make_parallel"]
