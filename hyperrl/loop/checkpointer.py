"""The checkpointer: module and optimizer state to and from a sharded checkpoint directory.

Owns the DTensor local/global conversion (each rank writes its local shards and, for sharded
tensors, their global shape, ``hyperrl.sharding`` spec and root mesh — ``fsdp``, or ``dp × tp``
under tensor parallelism; optimizer state
goes back onto DTensor parameters with their placements) and the file format
(:mod:`hyperrl.checkpoint`: safetensors + JSON, atomic, no pickle).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from hyperrl.distributed.strategy import LocalParallel
from hyperrl.loop.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    rng_states,
    save_checkpoint,
    set_rng_states,
)
from hyperrl.sharding.dtensor import dtensor_spec, local

__all__ = ["Checkpointer", "local"]


class Checkpointer:
    """``save(step, parts, state)`` / ``load(path, parts) -> state`` where ``parts`` maps a part
    name to ``(module, optimizer part name, optimizer)``."""

    def __init__(self, root: str | Path, parallel: LocalParallel | None = None, *, keep_last_k: int = 0):
        self.root = Path(root)
        self.parallel = parallel or LocalParallel()
        self.keep_last_k = keep_last_k

    def save(self, step: int, parts: dict[str, tuple], state: dict, *, _crash_after: str | None = None) -> Path:
        p = self.parallel
        files, layout, meshes = {}, {}, {}
        for name, (module, oname, opt) in parts.items():
            sd = module.state_dict()
            files[name] = {k: local(v) for k, v in sd.items()}
            for k, v in sd.items():
                if isinstance(v, DTensor):
                    mesh, spec = dtensor_spec(v, meshes)
                    layout[f"{name}/{k}"] = {"shape": list(v.shape), "spec": [list(d) for d in spec.dims],
                                             "mesh": [list(a) for a in mesh.axes], "ranks": list(mesh.ranks)}
            o = opt.state_dict()
            files[oname] = {"param_groups": o["param_groups"],
                            "state": {i: {k: local(v) for k, v in st.items()} for i, st in o["state"].items()}}
        path = save_checkpoint(self.root, step, parts=files, state=state, layout=layout, rng=rng_states(),
                               rank=p.rank, world_size=p.world, barrier=p.barrier, _crash_after=_crash_after)
        if self.keep_last_k and p.rank == 0:
            self.prune()
        return path

    def prune(self) -> list[Path]:
        """Delete the complete checkpoints older than the newest ``keep_last_k`` complete ones
        (anything not a well-formed ``step_<k>`` is left alone: discovery skips it); returns what went."""
        import shutil

        done = checkpoint_dirs(self.root)  # well-formed step_<k> only: a stray name is warned about, never parsed
        gone = done[: max(len(done) - self.keep_last_k, 0)]
        for c in gone:
            shutil.rmtree(c)
        return gone

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def candidates(self) -> list[Path]:
        """The well-formed, marked checkpoints, oldest first (strays warned about and ignored)."""
        return checkpoint_dirs(self.root)

    def newest_intact(self) -> tuple[Path | None, list[tuple[str, str]]]:
        """The newest checkpoint whose files verify on every rank (all ranks take the same one), and
        the ``(name, why)`` of each newer one skipped — said on stderr, naming the file."""
        import sys

        from hyperrl.loop.checkpoint import verify_checkpoint

        skipped = []
        for c in reversed(self.candidates()):
            why = None
            try:
                verify_checkpoint(c, rank=self.parallel.rank, world_size=self.parallel.world)
            except CheckpointError as e:
                why = str(e)
            if self.parallel.all_have_rows(int(why is None)):
                return c, skipped
            why = why or "another rank's shards do not verify"
            skipped.append((c.name, why))
            print(f"skipping checkpoint {c.name}: {why}", file=sys.stderr, flush=True)
        return None, skipped

    def probe(self) -> None:
        """Write, fsync and remove a file where checkpoints go — a read-only or missing directory is
        found before training starts, not at the first save."""
        import os

        f = self.root / f".write_probe.rank{self.parallel.rank}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(f, "wb") as fh:
                fh.write(b"probe" * 1024)
                fh.flush()
                os.fsync(fh.fileno())
            f.unlink()
        except OSError as e:
            raise CheckpointError(f"{self.root}: checkpoints cannot be written there ({type(e).__name__}: "
                                  f"{e.strerror or e}); fix its permissions or free space, or set run.out_dir"
                                  ) from None

    def load(self, path: str | Path, parts: dict[str, tuple], *, verified: bool = False) -> dict:
        """This rank's shards into the modules' local parameters and the optimizers; RNG restored;
        returns the checkpoint's ``state`` (``verified``: :meth:`newest_intact` has hashed it already)."""
        path = Path(path)
        ck = load_checkpoint(path, world_size=self.parallel.world, rank=self.parallel.rank, verified=verified)
        for name, (module, oname, opt) in parts.items():
            if name not in ck:
                raise CheckpointError(f"{path}: no {name!r} part (this run has one; the checkpoint was written "
                                      f"without it)")
            _load_local(module, ck[name], f"{path}: {name}")
            _load_optimizer(opt, ck[oname])
        set_rng_states(ck["rng"])
        return ck["state"]


@torch.no_grad()
def _load_local(module: torch.nn.Module, tensors: dict, where: str) -> None:
    for k, v in module.state_dict(keep_vars=True).items():
        if k not in tensors:
            raise CheckpointError(f"{where}: tensor {k!r} is missing")
        dst = local(v)
        if tuple(dst.shape) != tuple(tensors[k].shape):
            raise CheckpointError(f"{where}: {k!r} shard has shape {list(tensors[k].shape)}, this rank holds "
                                  f"{list(dst.shape)}")
        dst.copy_(tensors[k])


def _load_optimizer(opt, sd: dict) -> None:
    """Local optimizer state back onto (possibly DTensor) parameters, then ``load_state_dict``."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, st in sd["state"].items():
        p = params[int(i)]
        state[int(i)] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                         if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() == p.dim() else v
                         for k, v in st.items()}
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
