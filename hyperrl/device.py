"""Device choice in one place: ``cpu``, ``cuda``, or ``npu`` (torch-npu imported only if present)."""

from __future__ import annotations

import contextlib
import importlib.util

import torch

__all__ = ["pick_device", "collective_backend", "npu_available", "torch_dtype", "compute_context"]


def npu_available() -> bool:
    """True when ``torch_npu`` is installed and an Ascend NPU is visible (importing it registers ``torch.npu``)."""
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


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16`` (the config's dtype names)."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {name!r}: not a torch dtype (float32 | bfloat16 | float16)")
    return dt


def compute_context(device: torch.device, dtype: torch.dtype, param_dtype: torch.dtype):
    """Mixed precision for a forward whose parameters are ``param_dtype``: ``torch.autocast`` to
    ``dtype`` when they differ (matmuls and activations in bf16, fp32 master weights), else a no-op.
    Log-probs, entropies and losses are computed in fp32 after it (hyperrl.transforms upcasts)."""
    if dtype == param_dtype:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
