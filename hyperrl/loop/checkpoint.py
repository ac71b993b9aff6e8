"""Atomic, sharded checkpoints without pickle: safetensors for tensors, JSON for everything else.

Layout of ``<dir>/step_<k>/``: per rank ``r`` (suffix ``.rank<r>`` when the world size is > 1)
``<part>{sfx}.safetensors`` for each tensor part (``model``, ``critic``, …) holding that rank's
*local shards*, optimizer parts as ``<part>{sfx}.safetensors`` + ``<part>{sfx}.json``,
``rng{sfx}.safetensors``; then ``state.json`` (step, version, counters, data cursor, world size),
``layout.json`` (each sharded tensor's global shape, ``hyperrl.sharding`` spec and mesh —
``fsdp``, or ``dp × tp`` under tensor parallelism — what :func:`consolidate` needs) and, written last, ``COMPLETE``.
Every rank writes into ``step_<k>.tmp`` and fsyncs; after a barrier rank 0 writes the marker and
renames: a run killed mid-write leaves only a ``.tmp`` directory, which resume ignores. No rank
gathers another's shards (saving a large FSDP2 model costs each rank its own shard only).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "consolidate", "rng_states", "set_rng_states",
           "CheckpointError", "MARKER"]

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


def _json_bytes(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def rng_states() -> dict[str, torch.Tensor]:
    """This process's torch, Python ``random`` and NumPy global RNG states as tensors (no pickle)."""
    import random

    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": _json_bytes(random.getstate()),
            "numpy": _json_bytes([kind, keys.tolist(), pos, has_gauss, gauss])}


def set_rng_states(rng: dict[str, torch.Tensor]) -> None:
    """Restore the RNG states :func:`rng_states` recorded (torch, and Python's and numpy's when present)."""
    import random

    import numpy as np

    torch.set_rng_state(rng["torch"])
    if "python" in rng:
        version, internal, gauss = json.loads(bytes(rng["python"].tolist()).decode())
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        kind, keys, pos, has_gauss, gauss = json.loads(bytes(rng["numpy"].tolist()).decode())
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _suffix(rank: int, world_size: int) -> str:
    return "" if world_size == 1 else f".rank{rank}"


def _is_optim(part: dict) -> bool:
    return "param_groups" in part and "state" in part


def save_checkpoint(root: str | Path, step: int, *, parts: dict[str, dict], state: dict, rng: dict,
                    layout: dict | None = None, rank: int = 0, world_size: int = 1,
                    barrier: Callable[[], None] = lambda: None, _crash_after: str | None = None) -> Path:
    """Write ``root/step_<step>`` atomically; every rank of ``world_size`` calls it with its own
    ``parts`` (name → local tensors, or an optimizer ``state_dict`` of local tensors) and ``rng``.
    ``_crash_after`` (tests only) kills the process after writing that part."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    sfx = _suffix(rank, world_size)
    written = []
    for name, part in parts.items():
        if _is_optim(part):
            tensors, meta = _optim_to_files(part)
            (tmp / f"{name}{sfx}.json").write_text(json.dumps(meta))
            written.append(tmp / f"{name}{sfx}.json")
        else:
            tensors = {k: v.detach().clone().contiguous() for k, v in part.items()}
        save_file(tensors, tmp / f"{name}{sfx}.safetensors")
        written.append(tmp / f"{name}{sfx}.safetensors")
        if _crash_after == name:
            os._exit(9)
    save_file(rng, tmp / f"rng{sfx}.safetensors")
    written.append(tmp / f"rng{sfx}.safetensors")
    for f in written:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    barrier()  # every rank's shards are durable before the marker
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps({**state, "world_size": world_size, "parts": list(parts)},
                                                   indent=1))
        (tmp / "layout.json").write_text(json.dumps(layout or {}))
        for f in ("state.json", "layout.json"):
            with open(tmp / f, "rb") as fh:
                os.fsync(fh.fileno())
        (tmp / MARKER).write_text("ok\n")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    barrier()  # nobody reads or rewrites before the rename
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete ``step_<k>`` directory under ``root`` (its ``COMPLETE`` marker written), or None; half-
    written ``.tmp`` directories are never taken."""
    root = Path(root)
    if not root.exists():
        return None
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / MARKER).exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def load_checkpoint(path: str | Path, *, world_size: int = 1, rank: int = 0) -> dict:
    """This rank's parts of a complete checkpoint (``{part: tensors | optimizer state, "rng": …,
    "state": …}``); refuses one without its marker, from another world size, or missing a file."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise CheckpointError(f"{path}: no {MARKER} marker — the write did not finish; resume from an earlier "
                              f"checkpoint (latest complete: {latest_checkpoint(path.parent)})")
    state = json.loads((path / "state.json").read_text())
    if state.get("world_size", 1) != world_size:
        raise CheckpointError(f"{path}: written with world size {state.get('world_size')}, resuming with "
                              f"{world_size}; resharding optimizer state across world sizes is not supported")
    sfx = _suffix(rank, world_size)
    out = {"state": state}
    for name in [*state.get("parts", ["model", "optim"]), "rng"]:
        f = path / f"{name}{sfx}.safetensors"
        if not f.exists():
            raise CheckpointError(f"{path}: {f.name} is missing (rank {rank} of {world_size})")
        meta = path / f"{name}{sfx}.json"
        out[name] = _optim_from_files(load_file(f), json.loads(meta.read_text())) if meta.exists() else load_file(f)
    return out


def consolidate(path: str | Path, part: str = "model") -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of a tensor part, assembled from every rank's shards with the
    recorded specs — an HF-style state dict from a sharded FSDP2 checkpoint, on one process."""
    from hyperrl.sharding import Mesh, Spec, boxes

    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    world = state.get("world_size", 1)
    if world == 1:
        return load_file(path / f"{part}.safetensors")
    layout = json.loads((path / "layout.json").read_text())
    default = Mesh.of(fsdp=world)  # checkpoints written before meshes were recorded: FSDP2 over every rank
    shards = [load_file(path / f"{part}{_suffix(r, world)}.safetensors") for r in range(world)]
    out = {}
    for name, local in shards[0].items():
        rec = layout.get(f"{part}/{name}")
        if rec is None:  # not sharded: every rank holds it whole
            out[name] = local
            continue
        full = torch.empty(rec["shape"], dtype=local.dtype)
        spec = Spec(tuple(tuple(d) for d in rec["spec"]))
        mesh = Mesh(tuple((a, int(n)) for a, n in rec["mesh"]), tuple(rec["ranks"])) if "mesh" in rec else default
        for r, box in boxes(spec, mesh, tuple(rec["shape"]), name).items():
            full[box.slices()].copy_(shards[r][name])
        out[name] = full
    return out
