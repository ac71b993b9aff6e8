"""Atomic, sharded checkpoints without pickle: safetensors for tensors, JSON for everything else.

Layout of ``<dir>/step_<k>/``: per rank ``r`` (suffix ``.rank<r>`` when the world size is > 1)
``<part>{sfx}.safetensors`` for each tensor part (``model``, ``critic``, …) holding that rank's
*local shards*, optimizer parts as ``<part>{sfx}.safetensors`` + ``<part>{sfx}.json``,
``rng{sfx}.safetensors``; then ``state.json`` (step, version, counters, data cursor, world size; tensors in the
state — an asynchronous run's ready rows — go to ``state.safetensors``, referenced by name),
``layout.json`` (each sharded tensor's global shape, ``hyperrl.sharding`` spec and mesh —
``fsdp``, or ``dp × tp`` under tensor parallelism — what :func:`consolidate` needs) and, written last, ``COMPLETE``:
JSON holding every file's SHA-256 (each rank hashes its own files; rank 0 folds their manifests in).
Every rank writes into ``step_<k>.tmp`` and fsyncs; after a barrier rank 0 writes the marker and
renames: a run killed mid-write leaves only a ``.tmp`` directory, which resume ignores. A step is
written once — an intact ``step_<k>`` is never rewritten; a damaged one is set aside
(``step_<k>.damaged``) before the new one is renamed in, so at every instant an intact checkpoint
exists. :func:`verify_checkpoint` checks every file against the marker; :func:`checkpoint_dirs`
lists well-formed ``step_<k>`` directories only (anything else in the directory is warned about
and ignored). No rank gathers another's shards (saving a large FSDP2 model costs each rank its own
shard only).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hyperrl.errors import HyperRLError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_dirs", "verify_checkpoint",
           "consolidate", "read_state", "rng_states", "set_rng_states", "CheckpointError", "MARKER", "CRASH_POINTS"]

MARKER = "COMPLETE"
_STEP = re.compile(r"step_(\d+)")
# the filesystem operations of a save, in order (tests kill the process after each: ``_crash_after``)
CRASH_POINTS = ("parts", "rng", "fsync", "manifest", "state", "marker", "aside", "rename")


class CheckpointError(HyperRLError, RuntimeError):
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _crash(point: str, at: str | None) -> None:
    if at == point:
        os._exit(9)


def save_checkpoint(root: str | Path, step: int, *, parts: dict[str, dict], state: dict, rng: dict,
                    layout: dict | None = None, rank: int = 0, world_size: int = 1,
                    barrier: Callable[[], None] = lambda: None, _crash_after: str | None = None) -> Path:
    """Write ``root/step_<step>`` atomically; every rank of ``world_size`` calls it with its own
    ``parts`` (name → local tensors, or an optimizer ``state_dict`` of local tensors) and ``rng``.
    An intact ``step_<step>`` is returned as is (written once); a damaged one is set aside first.
    ``_crash_after`` (tests only) kills the process after that part or :data:`CRASH_POINTS` step."""
    root = Path(root)
    state_tensors: dict[str, torch.Tensor] = {}
    state = _split_tensors(state, "", state_tensors)  # before anything is written: a bad state refused first
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    intact = final.is_dir() and _verifies(final)
    barrier()
    if intact:
        return final
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    sfx = _suffix(rank, world_size)
    written = []
    try:
        for name, part in parts.items():
            if _is_optim(part):
                tensors, meta = _optim_to_files(part)
                (tmp / f"{name}{sfx}.json").write_text(json.dumps(meta))
                written.append(tmp / f"{name}{sfx}.json")
            else:
                tensors = {k: v.detach().clone().contiguous() for k, v in part.items()}
            save_file(tensors, tmp / f"{name}{sfx}.safetensors")
            written.append(tmp / f"{name}{sfx}.safetensors")
            _crash(name, _crash_after)
        _crash("parts", _crash_after)
        save_file(rng, tmp / f"rng{sfx}.safetensors")
        written.append(tmp / f"rng{sfx}.safetensors")
        _crash("rng", _crash_after)
        for f in written:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _crash("fsync", _crash_after)
        (tmp / f"manifest{sfx}.json").write_text(json.dumps({f.name: _sha256(f) for f in written}))
        _crash("manifest", _crash_after)
    except OSError as e:  # a full or read-only disk: the previous checkpoints stay as they were
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{final}: writing the checkpoint failed ({type(e).__name__}: {e}); the previous "
                              f"checkpoints are intact") from e
    barrier()  # every rank's shards are durable before the marker
    if rank == 0:
        try:
            _finish(root, tmp, final, state={**state, "world_size": world_size, "parts": list(parts)},
                    tensors=state_tensors, layout=layout or {}, world_size=world_size, crash=_crash_after)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{final}: writing the checkpoint failed ({type(e).__name__}: {e}); the previous "
                                  f"checkpoints are intact") from e
    barrier()  # nobody reads or rewrites before the rename
    return final


_TENSOR = "__tensor__"  # a tensor of the state, by its name in state.safetensors


def _split_tensors(obj, path: str, out: dict[str, torch.Tensor]):
    """``obj`` with every tensor (in nested dicts and lists) replaced by ``{"__tensor__": name}``; the
    tensors into ``out`` by name (their path in ``obj``)."""
    if torch.is_tensor(obj):
        out[path] = obj.detach().cpu().clone().contiguous()
        return {_TENSOR: path}
    if isinstance(obj, dict):
        if _TENSOR in obj:
            raise CheckpointError(f"state: {path or '/'} holds the reserved key {_TENSOR!r}")
        return {k: _split_tensors(v, f"{path}/{k}", out) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_split_tensors(v, f"{path}/{i}", out) for i, v in enumerate(obj)]
    return obj


def _join_tensors(obj, tensors: dict[str, torch.Tensor], where: Path):
    """:func:`_split_tensors` undone: each reference replaced by its tensor (a missing one named)."""
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            if obj[_TENSOR] not in tensors:
                raise CheckpointError(f"{where}: state tensor {obj[_TENSOR]!r} is missing from state.safetensors")
            return tensors[obj[_TENSOR]]
        return {k: _join_tensors(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors, where) for v in obj]
    return obj


def _finish(root: Path, tmp: Path, final: Path, *, state: dict, tensors: dict, layout: dict, world_size: int,
            crash: str | None) -> None:
    """Rank 0: state (its ``tensors`` in ``state.safetensors``, :func:`_split_tensors`) and layout, the marker with
    every file's hash, then the rename — a damaged ``final`` set aside first, so an intact checkpoint exists at
    every instant."""
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    (tmp / "layout.json").write_text(json.dumps(layout))
    files = ["state.json", "layout.json"]
    if tensors:
        save_file(tensors, tmp / "state.safetensors")
        files.append("state.safetensors")
    for f in files:
        with open(tmp / f, "rb") as fh:
            os.fsync(fh.fileno())
    _crash("state", crash)
    sums = {f: _sha256(tmp / f) for f in files}
    for r in range(world_size):
        sums.update(json.loads((tmp / f"manifest{_suffix(r, world_size)}.json").read_text()))
    with open(tmp / MARKER, "w") as fh:
        fh.write(json.dumps({"format": 2, "sha256": sums}, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    _crash("marker", crash)
    if final.exists():  # damaged (an intact one returned early): kept for inspection, ignored by discovery
        aside = final.with_name(final.name + ".damaged")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
        _crash("aside", crash)
    os.rename(tmp, final)
    _fsync_dir(root)
    _crash("rename", crash)


def _marker(path: Path) -> dict | None:
    """The marker's record (``{"sha256": {file: hex}}``; ``{}`` for a marker from before checksums),
    None when there is no marker."""
    m = path / MARKER
    if not m.is_file():
        return None
    text = m.read_text()
    if text.strip() == "ok":
        return {}
    try:
        rec = json.loads(text)
    except json.JSONDecodeError:
        raise CheckpointError(f"{m}: the marker is not readable (damaged)") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), dict):
        raise CheckpointError(f"{m}: the marker holds no checksums (damaged)")
    return rec


def verify_checkpoint(path: str | Path, *, rank: int | None = None, world_size: int | None = None) -> None:
    """Every file the marker lists exists and has its recorded SHA-256 (``rank``: only that rank's
    files and the shared ones). Raises :class:`CheckpointError` naming the file and what is wrong.
    A marker written before checksums existed: only the files' presence is checked."""
    path = Path(path)
    rec = _marker(path)
    if rec is None:
        raise CheckpointError(f"{path}: no {MARKER} marker — the write did not finish")
    sums = rec.get("sha256", {})
    if rank is not None and world_size and world_size > 1:
        mine = f".rank{rank}."
        sums = {f: h for f, h in sums.items() if ".rank" not in f or mine in f}
    for f, want in sorted(sums.items()):
        fp = path / f
        if not fp.is_file():
            raise CheckpointError(f"{fp}: missing (listed in {MARKER})")
        if _sha256(fp) != want:
            raise CheckpointError(f"{fp}: checksum mismatch — the file is damaged (truncated or altered)")
    if not sums and not (path / "state.json").is_file():
        raise CheckpointError(f"{path / 'state.json'}: missing")


def _verifies(path: Path) -> bool:
    try:
        verify_checkpoint(path)
        return True
    except CheckpointError:
        return False


def checkpoint_dirs(root: str | Path, *, warn: bool = True) -> list[Path]:
    """The well-formed, marked ``step_<k>`` directories under ``root``, oldest first. Anything else
    there (``step_6.bak``, ``step_6_backup``, a ``.tmp`` a killed write left, a set-aside
    ``.damaged``) is ignored — with a warning naming it when ``warn``."""
    root = Path(root)
    if not root.is_dir():
        return []
    done = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and _STEP.fullmatch(p.name):
            if (p / MARKER).exists():
                done.append(p)
            elif warn:
                print(f"warning: {p}: no {MARKER} marker — ignored", file=sys.stderr)
        elif warn and not p.name.startswith("."):
            why = ("an unfinished write (killed mid-save)" if p.name.endswith(".tmp") else
                   "a damaged checkpoint set aside" if p.name.endswith(".damaged") else "not a step_<k> directory")
            print(f"warning: {p}: {why} — ignored", file=sys.stderr)
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete ``step_<k>`` directory under ``root`` (its ``COMPLETE`` marker written), or None; half-
    written ``.tmp`` directories and other names are never taken (:func:`checkpoint_dirs`)."""
    done = checkpoint_dirs(root, warn=False)
    return done[-1] if done else None


def load_checkpoint(path: str | Path, *, world_size: int = 1, rank: int = 0, verified: bool = False) -> dict:
    """This rank's parts of a complete checkpoint (``{part: tensors | optimizer state, "rng": …,
    "state": …}``); refuses one without its marker, that does not verify (unless the caller has
    just ``verified`` it), from another world size, or missing a file."""
    path = Path(path)
    if not (path / MARKER).exists():
        raise CheckpointError(f"{path}: no {MARKER} marker — the write did not finish; resume from an earlier "
                              f"checkpoint (latest complete: {latest_checkpoint(path.parent)})")
    if not verified:
        verify_checkpoint(path, rank=rank, world_size=world_size)
    state = read_state(path)
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


def read_state(path: str | Path) -> dict:
    """A checkpoint's ``state.json``, its tensors (``state.safetensors``) in place."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    f = path / "state.safetensors"
    return _join_tensors(state, load_file(f), path) if f.is_file() else state


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
