"""The transport contract (see the package doc) and its registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from hyperrl.registry import Registry

__all__ = ["TRANSPORTS", "register_transport", "Transport", "view_of", "transport_class", "need_cuda"]

TRANSPORTS: Registry = Registry("vllm weight transport")
register_transport = TRANSPORTS.register


def need_cuda(name: str, what: str) -> None:
    """Refuse transport ``name`` (``what`` needs CUDA) on a process without a CUDA GPU, naming the fix."""
    if not torch.cuda.is_available():
        raise ValueError(f"transport={name}: {what} needs a CUDA GPU (torch.cuda.is_available() is False); use "
                         "transport=shm on CPU")


def transport_class(name: str):
    """The transport class registered as ``name`` (an error naming the registered ones otherwise)."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r}: one of {', '.join(TRANSPORTS.names())}")
    return TRANSPORTS.get(name)


def view_of(t: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """The contiguous run of ``t`` at element ``offset`` as ``shape`` (one checkpoint tensor of a
    fused engine parameter)."""
    n = 1
    for s in shape:
        n *= s
    return t.reshape(-1)[offset:offset + n].view(tuple(shape))


class Transport(ABC):
    """Base of the transports: ``shapes`` — the engine's parameters (name → a meta tensor of its
    shape) — and ``dtype``, what the worker loads. ``in_place``: ``buffers()`` returns slots a
    publisher fills directly. Subclasses implement :meth:`payload` and :meth:`receive`."""

    name = ""
    in_place = False
    on_device = False  # staged pieces stay on their device (the worker reads them there), else a CPU copy
    native = False  # vLLM's own weight-transfer round (send), not a payload for hyperrl's worker load

    def __init__(self, shapes: dict[str, torch.Tensor], dtype: torch.dtype):
        self.shapes, self.dtype = shapes, dtype

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ValueError`` naming the fix where this transport cannot run in this process."""
        return None  # a default hook: hyperrl's own transports run wherever the engine does

    def stage(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What the transaction keeps for the checked piece ``t``: a copy in ``dtype`` — on CPU, or where ``t`` is
        (``on_device``)."""
        t = t.detach()
        return (t.to(dtype=self.dtype) if self.on_device else t.to("cpu", self.dtype)).contiguous()

    def buffers(self) -> dict[str, torch.Tensor] | None:
        """The destination slot of every parameter (an in-place transport), else None."""
        return None

    @abstractmethod
    def payload(self, staged: dict[str, torch.Tensor], views, version: int) -> tuple:
        """The worker call's arguments (plain data) for the ``staged`` pieces; ``views(name, t)``
        lists each engine parameter's ``(checkpoint name, element offset, shape)``."""

    def done(self) -> None:
        """After the worker call (successful or not): release what the payload needed."""
        return None  # a default hook: nothing to do

    def close(self) -> None:
        """Release the transport's resources (the engine is closing)."""
        return None  # a default hook: nothing to do

    @staticmethod
    @abstractmethod
    def receive(*payload) -> Iterator[tuple[str, torch.Tensor]]:
        """(In vLLM's worker.) The ``(checkpoint name, tensor)`` pairs of a payload, each cloned."""
