"""``file``: the staged pieces saved as one safetensors file the worker reads (any machine with a
filesystem the workers share; the fallback where /dev/shm is missing)."""

from __future__ import annotations

import os
import tempfile

import torch

from hyperrl.rollout.transports.base import Transport, register_transport, view_of

__all__ = ["FileTransport"]


@register_transport("file")
class FileTransport(Transport):
    """The safetensors-file transport (see the module doc)."""

    name = "file"

    def __init__(self, shapes: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__(shapes, dtype)
        self._tmp = tempfile.TemporaryDirectory(prefix="hyperrl-vllm-")
        self._path: str | None = None

    def payload(self, staged, views, version: int) -> tuple:
        from safetensors.torch import save_file

        self._path = os.path.join(self._tmp.name, f"v{version}.safetensors")
        save_file({hf: view_of(v, rel, shape).contiguous() for k, v in staged.items()
                   for hf, rel, shape in views(k, v)}, self._path)
        return (self._path,)

    def done(self) -> None:
        if self._path is not None:
            os.remove(self._path)
            self._path = None

    def close(self) -> None:
        self._tmp.cleanup()

    @staticmethod
    def receive(path: str):
        """Read the file (its read time counts as the transport's) and yield its tensors."""
        from safetensors.torch import load_file

        yield from load_file(path).items()
