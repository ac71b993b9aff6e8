"""``cuda_ipc``: CUDA IPC handles of the staged device tensors (pickled; the worker rebuilds each
tensor from its handle and clones it) — no copy through host memory on one GPU node."""

from __future__ import annotations

import pickle

from hyperrl.rollout.transports.base import Transport, need_cuda, register_transport, view_of

__all__ = ["CudaIpcTransport"]


@register_transport("cuda_ipc")
class CudaIpcTransport(Transport):
    """The CUDA IPC transport (see the module doc)."""

    name, on_device = "cuda_ipc", True

    @classmethod
    def check_available(cls) -> None:
        need_cuda(cls.name, "CUDA IPC")

    def payload(self, staged, views, version: int) -> tuple:
        from torch.multiprocessing.reductions import reduce_tensor

        return (pickle.dumps({hf: reduce_tensor(view_of(v, rel, shape)) for k, v in staged.items()
                              for hf, rel, shape in views(k, v)}),)

    @staticmethod
    def receive(handles: bytes):
        """Rebuild each tensor from its IPC handle and clone it."""
        for name, (fn, args) in pickle.loads(handles).items():
            yield name, fn(*args).clone()
