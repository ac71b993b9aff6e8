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
``cuda_ipc`` (CUDA IPC handles). A new transport (NCCL, vLLM's native weight-transfer API) is one
file registering one class.
"""

from hyperrl.rollout.transports.base import TRANSPORTS, Transport, register_transport, view_of
from hyperrl.rollout.transports.cuda_ipc import CudaIpcTransport
from hyperrl.rollout.transports.file import FileTransport
from hyperrl.rollout.transports.shm import ShmTransport

__all__ = ["TRANSPORTS", "Transport", "register_transport", "view_of", "ShmTransport", "FileTransport",
           "CudaIpcTransport"]
