"""vLLM's own RL weight-transfer API (vllm 0.32, ``vllm.distributed.weight_transfer``) as transports:
``vllm_ipc`` (vLLM's CUDA IPC engine: trainer and engine on one node's GPUs) and ``vllm_nccl`` (vLLM's
NCCL engine: a process group of the trainer's rank 0 and the engine's workers, a broadcast per round).

The vLLM engine is started with ``weight_transfer_config={"backend": "ipc" | "nccl"}`` — each worker then
holds vLLM's ``IPCWeightTransferEngine`` / ``NCCLWeightTransferEngine`` — and a commit drives vLLM's
trainer-side engine (``IPCTrainerWeightTransferEngine`` / ``NCCLTrainerWeightTransferEngine``, built once
by its ``trainer_init``) whose ``send_weights()`` runs the round trip ``start_weight_update →
update_weights → finish_weight_update`` through :class:`LLMClient` (the offline ``LLM``'s
``collective_rpc`` to the worker methods of the same names). What it sends is :class:`StagedSource`:
vLLM's ``WeightSource`` contract over the publication hyperrl staged — hyperrl's layout drives it: the
engine's fused parameters (``qkv_proj``, ``gate_up_proj``, stacked experts) travel as the checkpoint
tensors they are made of (the engine's checkpoint views: contiguous blocks, no copy), which vLLM's
``load_weights`` fuses again, exactly as the ``shm`` path loads them.

hyperrl checks every piece before any of this (names, shapes, finite values: the transaction), so a
refused publication never reaches vLLM. Unlike the ``shm`` path, vLLM loads the tensors as they arrive
(layerwise reload): a failure inside vLLM's round — a broken NCCL group, a dead worker — leaves the
engine in a state hyperrl cannot vouch for; the commit then raises ``WeightPublishError`` saying so.

Both need CUDA in the trainer's process (``IPCTrainerWeightTransferEngine`` reads the current device;
NCCL is GPU-only); on a CPU-only torch the engine refuses them when it is built. vLLM's ``sharded_rdt``
and ``nccl_m2n`` backends take the trainer's placements and compute the destinations themselves (m2n
sends fused and stacked parameters whole to every rank): across a resharding, hyperrl's own planner
(the direct plan) is the path — see docs/sharding.md.
"""

from __future__ import annotations

import socket
from abc import abstractmethod

import torch

from hyperrl.rollout.transports.base import Transport, need_cuda, register_transport, view_of

__all__ = ["LLMClient", "StagedSource", "VLLMIpcTransport", "VLLMNcclTransport"]


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an offline ``LLM``: each call is the worker method of
    the same name on every worker (``collective_rpc``; plain data, as vLLM's RPC serialises it)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", args=(update_info,))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """(``weight_version``: the protocol's label for serving front ends; the worker method takes none.)"""
        self.llm.collective_rpc("finish_weight_update")


class StagedSource:
    """vLLM's ``WeightSource`` contract (``metadata()``, re-iterable ``(name, tensor)`` pairs, ``held_names``)
    over the pieces staged for one publication: each engine parameter as its checkpoint tensors —
    ``views(name, t)`` lists ``(checkpoint name, element offset, shape)`` — in one fixed order.
    :meth:`set` points it at the next publication's pieces (vLLM's full-resync engines replay one source
    every round)."""

    def __init__(self, views):
        self.views, self.staged = views, {}

    def set(self, staged: dict[str, torch.Tensor]) -> None:
        self.staged = staged

    def _items(self):
        for name, t in self.staged.items():
            for ckpt, offset, shape in self.views(name, t):
                yield ckpt, t, offset, tuple(shape)

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(ckpt, t.dtype, shape) for ckpt, t, _, shape in self._items()]

    def __iter__(self):
        for ckpt, t, offset, shape in self._items():
            yield ckpt, view_of(t, offset, shape)

    def held_names(self):
        return None  # every parameter: one trainer process holds the whole publication

    def groups(self) -> list[list[str]]:
        return [[m.name] for m in self.metadata()]

    def iter_groups(self):
        for name, t in self:
            yield [name], [t]


class _NativeTransport(Transport):
    """Common driver half: pieces stay on their device; a commit is vLLM's own round (:meth:`send`), not
    hyperrl's worker load — so there is no payload and no worker half."""

    native, on_device = True, True  # vLLM's engines read the pieces where they are
    vllm_backend = ""

    def __init__(self, shapes, dtype):
        super().__init__(shapes, dtype)
        self._trainer, self._source = None, None

    @classmethod
    def check_available(cls) -> None:
        """Refuse where vLLM's trainer side cannot run (no CUDA in this process), naming the fix."""
        need_cuda(cls.name, f"vLLM's {cls.vllm_backend} weight transfer (its trainer side, in this process)")

    def payload(self, staged, views, version: int) -> tuple:
        raise TypeError(f"transport={self.name} is vLLM's own round trip (send), not a hyperrl worker payload")

    @staticmethod
    def receive(*payload):
        raise TypeError("vLLM's native transports have no hyperrl worker half (vLLM's worker engine receives)")

    def send(self, llm, staged: dict[str, torch.Tensor], views, version: int) -> None:
        """One publication through vLLM's trainer-side engine (built at the first call)."""
        if self._trainer is None:
            self._source = StagedSource(views)
            self._trainer = self._trainer_init(LLMClient(llm), self._source, llm)
        self._source.set(staged)
        try:
            self._trainer.send_weights()
        finally:
            self._source.set({})  # no reference to the publication is kept

    @abstractmethod
    def _trainer_init(self, client, source, llm):
        """vLLM's trainer-side engine of this backend, rendezvoused with ``llm``'s workers through ``client``."""

    def close(self) -> None:
        if self._trainer is not None:
            self._trainer.shutdown()
            self._trainer = None


@register_transport("vllm_ipc")
class VLLMIpcTransport(_NativeTransport):
    """vLLM's CUDA IPC weight transfer (``IPCTrainerWeightTransferEngine``; one node: the engine's GPUs
    open the trainer's tensors by handle). Unpacked: one handle per checkpoint tensor."""

    name, vllm_backend = "vllm_ipc", "ipc"

    def _trainer_init(self, client, source, llm):
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        return IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0, packed=False), client=client,
                                                          source=source)


@register_transport("vllm_nccl")
class VLLMNcclTransport(_NativeTransport):
    """vLLM's NCCL weight transfer (``NCCLTrainerWeightTransferEngine``): at the first commit the trainer
    opens rank 0 of an NCCL group of 1 + the engine's workers (a TCP rendezvous on a free local port) and
    every round broadcasts the pieces, packed, while the workers receive (vLLM runs the two sides
    concurrently)."""

    name, vllm_backend = "vllm_nccl", "nccl"

    def _trainer_init(self, client, source, llm):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        workers = llm.llm_engine.vllm_config.parallel_config.world_size
        with socket.socket() as s:  # a free port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=1 + workers, rank=0)
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
