"""Weight transports of the vLLM engine: how a staged publication reaches vLLM's worker processes.

A transport is one small class in a registry (``TRANSPORTS``), with both of its halves in one file:

* the **driver half**, in the engine's process: ``stage(name, t)`` keeps what the transaction holds
  for a checked piece (a copy into the transport, never a reference to the trainer's tensor),
  ``buffers()`` (an in-place transport's destination slots for a publisher to fill, else None),
  ``payload(staged, views, version)`` — the plain-data arguments of the worker call (vLLM's RPC
  serialises with msgpack: no tensors) — and ``done()`` after the call;
* the **worker half**, ``receive(*payload)``, a static method run inside vLLM's worker by
  :meth:`~hyperrl.rollout.vllm_worker.WeightSyncExtension.hyperrl_load`: it yields ``(checkpoint
  name, tensor)`` pairs, each cloned out of the transport.

Built-ins: ``shm`` (one /dev/shm segment, the CPU default), ``file`` (a safetensors file),
``cuda_ipc`` (CUDA IPC handles); ``vllm_ipc`` and ``vllm_nccl`` — vLLM's own weight-transfer engines
(:mod:`~hyperrl.rollout.transports.vllm_native`: a commit is vLLM's round trip, driven with the
pieces hyperrl staged, in its checkpoint views). A new transport is one file registering one class.
"""

from hyperrl.rollout.transports.base import TRANSPORTS, Transport, register_transport, transport_class, view_of
from hyperrl.rollout.transports.cuda_ipc import CudaIpcTransport
from hyperrl.rollout.transports.file import FileTransport
from hyperrl.rollout.transports.shm import ShmTransport
from hyperrl.rollout.transports.vllm_native import LLMClient, StagedSource, VLLMIpcTransport, VLLMNcclTransport

__all__ = ["TRANSPORTS", "Transport", "register_transport", "transport_class", "view_of", "ShmTransport",
           "FileTransport", "CudaIpcTransport", "VLLMIpcTransport", "VLLMNcclTransport", "LLMClient", "StagedSource"]
