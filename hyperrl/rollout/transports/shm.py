"""``shm``: one shared-memory segment under /dev/shm holding every parameter at a 64-byte-aligned
slot; the worker maps the segment and clones each tensor out. In place: a publisher writes the
slots directly (``buffers()``), and the worker reads the segment only at commit, so an aborted
publication leaves the served version intact."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

from hyperrl.rollout.transports.base import Transport, register_transport

__all__ = ["ShmTransport", "WorkerShards"]


@register_transport("shm")
class ShmTransport(Transport):
    """The shared-memory transport (see the module doc)."""

    name, in_place = "shm", True

    def __init__(self, shapes: dict[str, torch.Tensor], dtype: torch.dtype):
        super().__init__(shapes, dtype)
        self.slots, off = {}, 0  # name → byte offset in the segment (64-byte aligned)
        for k, t in shapes.items():
            self.slots[k] = off
            off += -(-t.numel() * dtype.itemsize // 64) * 64
        self.nbytes, self.segment, self.path = max(off, 64), None, None

    def _slot(self, name: str) -> torch.Tensor:
        if self.segment is None:
            path = Path("/dev/shm") / f"hyperrl-vllm-{os.getpid()}-{id(self)}"
            self.path = str(path)
            self.segment = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
            weakref.finalize(self, path.unlink, missing_ok=True)  # also at interpreter exit
        want = self.shapes[name]
        off, n = self.slots[name], want.numel() * self.dtype.itemsize
        return self.segment[off:off + n].view(self.dtype).view(want.shape)

    def stage(self, name: str, t: torch.Tensor) -> torch.Tensor:
        view = self._slot(name)
        if t.data_ptr() != view.data_ptr():  # a publisher that filled buffers() wrote it in place
            view.copy_(t.detach().reshape(view.shape))
        return view  # no reference to the trainer's tensor is kept

    def buffers(self) -> dict[str, torch.Tensor]:
        """The segment's slot of every parameter (padding rows never written: zeros since the segment was made)."""
        return {name: self._slot(name) for name in self.shapes}

    def payload(self, staged, views, version: int) -> tuple:
        dt = str(self.dtype).removeprefix("torch.")
        manifest = [[hf, dt, list(shape), self.slots[k] + rel * self.dtype.itemsize]
                    for k, v in staged.items() for hf, rel, shape in views(k, v)]
        return self.path, self.nbytes, manifest

    def close(self) -> None:
        if self.segment is not None:
            self.segment = None
            Path(self.path).unlink(missing_ok=True)

    @staticmethod
    def receive(path: str, size: int, manifest: list):
        """Map the segment and yield each manifest entry ``[name, dtype, shape, byte offset]``, cloned."""
        seg = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for name, dtype, shape, off in manifest:
            dt = getattr(torch, dtype)
            n = dt.itemsize
            for s in shape:
                n *= s
            yield name, seg[off:off + n].view(dt).view(shape).clone()


class WorkerShards(Transport):
    """``shm`` into a tensor-parallel vLLM engine: one segment per worker holding only that worker's shards, in
    vLLM's local layout (``shapes[r]``). Staging a whole engine parameter copies each worker's planned boxes
    (``cuts[name][r]``: :func:`hyperrl.sharding.vllm.worker_cuts`) into that worker's segment, so a worker maps
    and reads exactly its share — ``received[r]``, the real (unpadded) bytes of the last publication, is the
    plan's per-rank ``B_recv_min``. Not in place: a publisher's whole parameters are cut, not written into."""

    name = "shm"

    def __init__(self, shapes: list[dict[str, torch.Tensor]], dtype: torch.dtype, cuts: dict[str, list]):
        super().__init__(shapes[0], dtype)
        self.workers = [ShmTransport(s, dtype) for s in shapes]
        self.cuts = cuts
        self.received = [0] * len(shapes)

    def stage(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        for r, (worker, cuts) in enumerate(zip(self.workers, self.cuts[name])):
            slot = worker._slot(name)
            for src, dst, real in cuts:
                slot[dst.slices()].copy_(t[src.slices()])
                self.received[r] += real * self.dtype.itemsize
        return self.workers[0]._slot(name)  # no reference to the trainer's tensor is kept

    def payload(self, staged, views, version: int) -> tuple:
        """One ``shm`` payload per worker (its own segment and manifest): the RPC carries all of them, each worker
        maps only ``payloads[tp_rank]``."""
        return ([w.payload({k: None for k in staged}, lambda k, _, w=w: [(k, 0, tuple(w.shapes[k].shape))], version)
                 for w in self.workers],)

    def done(self) -> None:
        self.received = [0] * len(self.workers)

    @property
    def path(self) -> list[str]:
        return [w.path for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.close()

    @staticmethod
    def receive(*payload):
        return ShmTransport.receive(*payload)
