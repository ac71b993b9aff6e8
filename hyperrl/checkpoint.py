"""Atomic checkpoints without pickle: safetensors for tensors, JSON for everything else.

Layout: ``<dir>/step_<k>/`` with ``model.safetensors``, ``optim.safetensors`` + ``optim.json``,
``state.json`` (step, version, counters, data cursor, RNG states, world size) and, written last,
``COMPLETE``. Everything is written into ``step_<k>.tmp`` first, fsynced, then renamed: a run
killed mid-write leaves only a ``.tmp`` directory, which resume ignores.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointError", "MARKER"]

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message says why."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optim_to_files(optim_state: dict) -> tuple[dict, dict]:
    tensors, meta = {}, {"param_groups": optim_state["param_groups"], "state": {}}
    for idx, st in optim_state["state"].items():
        meta["state"][str(idx)] = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().contiguous()
                meta["state"][str(idx)][k] = "tensor"
            else:
                meta["state"][str(idx)][k] = v
    return tensors, meta


def _optim_from_files(tensors: dict, meta: dict) -> dict:
    state = {}
    for idx, st in meta["state"].items():
        key = int(idx) if idx.isdigit() else idx  # torch optimizers key by index; full state dicts by name
        state[key] = {k: (tensors[f"{idx}.{k}"] if v == "tensor" else v) for k, v in st.items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(root: str | Path, step: int, *, model: dict, optim: dict, state: dict, rng: dict,
                    _crash_after: str | None = None) -> Path:
    """Write ``root/step_<step>`` atomically. ``_crash_after`` (tests only) kills the process mid-write."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().clone().contiguous() for k, v in model.items()}, tmp / "model.safetensors")
    if _crash_after == "model":
        os._exit(9)
    o_tensors, o_meta = _optim_to_files(optim)
    save_file(o_tensors, tmp / "optim.safetensors")
    (tmp / "optim.json").write_text(json.dumps(o_meta))
    save_file(rng, tmp / "rng.safetensors")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    (tmp / MARKER).write_text("ok\n")
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    if not root.exists():
        return None
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / MARKER).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_checkpoint(path: str | Path, *, world_size: int = 1) -> dict:
    """Load a complete checkpoint; refuses one without its marker or from another world size."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise CheckpointError(f"{path}: no {MARKER} marker — the write did not finish; resume from an earlier "
                              f"checkpoint (latest complete: {latest_checkpoint(path.parent)})")
    state = json.loads((path / "state.json").read_text())
    if state.get("world_size", 1) != world_size:
        raise CheckpointError(f"{path}: written with world size {state.get('world_size')}, resuming with "
                              f"{world_size}; resharding optimizer state across world sizes is not supported")
    return {
        "model": load_file(path / "model.safetensors"),
        "optim": _optim_from_files(load_file(path / "optim.safetensors"),
                                   json.loads((path / "optim.json").read_text())),
        "rng": load_file(path / "rng.safetensors"),
        "state": state,
    }
