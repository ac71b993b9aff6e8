"""Device choice in one place: ``cpu``, ``cuda``, or ``npu`` (torch-npu imported only if present)."""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["pick_device", "collective_backend", "npu_available"]


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(torch.npu.is_available())


def pick_device(requested: str = "auto") -> torch.device:
    """``"auto"`` → npu if torch-npu sees one, else cuda, else cpu; an explicit choice is checked."""
    if requested == "auto":
        if npu_available():
            return torch.device("npu")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False; use 'cpu' or 'auto'")
    if dev.type == "npu" and not npu_available():
        raise RuntimeError("device='npu' requested but torch-npu is not installed or sees no NPU; use 'cpu' or 'auto'")
    return dev


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for a device type: gloo (cpu), nccl (cuda), hccl (npu)."""
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
