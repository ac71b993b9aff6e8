"""The earlier name of :mod:`hyperrl.distributed.strategy` (the parallel strategy: data-parallel, TP, CP and EP
rules), kept for code that imports it."""

from hyperrl.distributed.strategy import LocalParallel, TorchDataParallel, TorchParallel, make_parallel

__all__ = ["LocalParallel", "TorchParallel", "TorchDataParallel", "make_parallel"]
