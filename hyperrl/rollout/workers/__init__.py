"""Rollout workers: who generates an asynchronous run's requests, and where.

A worker is a handle the asynchronous loop drives from one driver thread per worker:

* ``name`` — what errors name (``rollout-worker-0``, …);
* ``generate_requests(requests, sampling, stop_after=LIVE)`` — continue the requests
  (:mod:`hyperrl.rollout.requests`); blocks until done or interrupted and returns ``(rows,
  steps)``: ``steps`` = the decode steps that ran before an interruption (None: it was not
  interrupted) — what an event log records. ``stop_after=k`` replays such a call: it stops after
  exactly ``k`` decode steps (``None``: runs to the end), whatever ``interrupt`` says;
* ``interrupt()`` / ``resume()`` — a sticky pause: while interrupted, a running or newly started
  generation stops at its next decode step and returns the unfinished rows
  ``finish_reason = aborted`` (publication is pause → publish → resume);
* ``restart()`` — a worker that died (:class:`WorkerDied`) is started again serving the
  engine's current version, or raises :class:`WorkerError` naming it when it may not.

An **executor** (registry :data:`EXECUTORS`, config ``async.executor``) turns the run's engine
into a :class:`Workers` set: ``engine`` — what the learner publishes to and evaluates with —
and the worker handles. ``thread``: the engine itself, in this process (one worker); ``ray``:
``workers`` Ray actors, each with its own engine copy, behind one engine that fans a publication
out to all of them (:mod:`hyperrl.rollout.workers.ray_executor`).

The package: this module is the registry (:data:`EXECUTORS`, each executor declaring its
:class:`ExecutorCapabilities` where it registers); :mod:`.base` the worker contract, the
:class:`Workers` set, the in-process :class:`LocalWorker` and the errors; :mod:`.ray_executor` the
Ray executor (actors, the fan-out engine, restarts).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperrl.registry import Registry
from hyperrl.rollout.workers.base import LIVE, LocalWorker, WorkerDied, WorkerError, Workers, decode_flag

__all__ = ["EXECUTORS", "register_executor", "ExecutorCapabilities", "Workers", "LocalWorker", "WorkerError",
           "WorkerDied", "LIVE", "decode_flag"]


@dataclass(frozen=True)
class ExecutorCapabilities:
    """What an executor's workers can do, declared where it registers (known at load, before any worker exists):
    ``parks`` — park a generation with its KV cache kept (``async.kv_cache: keep``); ``remote`` — build engines in
    their own processes (the run's engine factory describes its engine — an ``EngineSpec`` — instead of starting
    one in the learner's process); ``adapters`` — their engines receive LoRA adapters (an engine's
    ``lora_adapters``), not only merged weights; ``local_engines`` — the engine replicas it starts on this machine
    (their devices are checked against the machine's at load)."""

    parks: bool = False
    remote: bool = False
    adapters: bool = False
    local_engines: int = 0  # engine replicas it starts on this machine (each taking its engine's devices)


EXECUTORS: Registry = Registry("rollout executor", capabilities=ExecutorCapabilities())
register_executor = EXECUTORS.register


@register_executor("thread", capabilities=ExecutorCapabilities(parks=True, adapters=True))
def thread_executor(engine) -> Workers:
    """One rollout worker: a thread of the learner's process driving the run's engine (no copy; the
    learner publishes into it; the thread uses ``run.threads`` torch threads of its own)."""
    return Workers(engine, [LocalWorker(engine)], parking=True)


_RAY_HINT = "pip install -c constraints.txt -e '.[async]' (Ray is the async extra)"


def _ray_address(address: str | None) -> str | None:
    """The cluster to join: ``address``, else Ray's own ``RAY_ADDRESS`` where it is set, else None (a local one)."""
    import os

    return address or os.environ.get("RAY_ADDRESS") or None


def _ray_capabilities(*, workers: int = 1, address: str | None = None, **_) -> ExecutorCapabilities:
    """Ray's workers build their own engines; on a local cluster (no ``address``) all ``workers`` on this machine."""
    return ExecutorCapabilities(remote=True, local_engines=workers if _ray_address(address) is None else 0)


@register_executor("ray", requires=(("ray", _RAY_HINT),), capabilities=_ray_capabilities)
def ray_executor(engine, *, workers: int = 1, num_cpus: float = 1.0, threads: int = 1, address: str | None = None,
                 max_restarts: int = 10, timeout_s: float = 120.0) -> Workers:
    """``workers`` Ray actors (``num_cpus`` each, spread over the cluster's nodes, ``threads`` torch
    threads each), every one a copy of the run's engine born serving its version (a transformers
    engine's model; a vLLM engine is started by each actor from its description, one per actor). A publication
    reaches all of them through one engine (two-phase: every worker stages and checks the
    pieces, then all commit; a refusal or a stuck worker aborts everywhere). A worker that dies
    is restarted — serving the current version — up to ``max_restarts`` times each; its requests
    are generated again from their exact partial tokens. ``address``: a running cluster
    (``"auto"``, ``"ray://…"``); None = the already-initialised Ray, else ``RAY_ADDRESS`` where it is
    set, else a local one of this run's own started with ``num_cpus = workers · num_cpus``.
    ``timeout_s``: deadline of every call (start, publication)."""
    from hyperrl.rollout.workers.ray_executor import ray_workers

    return ray_workers(engine, workers=workers, num_cpus=num_cpus, threads=threads, address=_ray_address(address),
                       max_restarts=max_restarts, timeout_s=timeout_s)
