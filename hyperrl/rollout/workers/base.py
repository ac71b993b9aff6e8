"""The rollout-worker protocol and its in-process worker: what the asynchronous loop drives.

A worker is a handle with ``name``, ``generate_requests(requests, sampling, stop_after=LIVE)``,
``interrupt()`` / ``resume()`` and ``restart()`` (:mod:`hyperrl.rollout.workers` documents the
contract and the executors that make workers). :class:`LocalWorker` drives an engine in this
process; :mod:`hyperrl.rollout.workers.ray_executor` implements the same protocol over Ray actors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hyperrl.errors import HyperRLError

__all__ = ["Workers", "LocalWorker", "WorkerError", "WorkerDied", "LIVE", "decode_flag"]


LIVE = -1  # ``stop_after`` of a live call: interruptible, its decode steps counted


class WorkerError(HyperRLError, RuntimeError):
    """A rollout worker died past its restarts, hung past its deadline, or returned rows that break
    the contract; the message names it."""


class WorkerDied(WorkerError):
    """The worker's process is gone (its in-flight requests came back to nobody): restart it."""

    def __init__(self, name: str, cause: BaseException | str):
        super().__init__(f"{name} died: {cause}")
        self.name = name


class _Counting:
    """A live call's stop flag: ``inner.is_set()``, counting the decode steps it let run."""

    def __init__(self, inner):
        self.inner, self.steps, self.fired = inner, 0, False

    def is_set(self) -> bool:
        if self.inner.is_set():
            self.fired = True
            return True
        self.steps += 1
        return False

    @property
    def result(self) -> int | None:
        return self.steps if self.fired else None


class _StopAfter:
    """A replayed call's stop flag: set after exactly ``steps`` decode steps (never when None)."""

    def __init__(self, steps: int | None):
        self.steps, self.seen = steps, 0

    def is_set(self) -> bool:
        if self.steps is None:
            return False
        self.seen += 1
        return self.seen > self.steps

    @property
    def result(self) -> int | None:
        return self.steps


def decode_flag(inner, stop_after: int | None):
    """The flag an engine's decode loop checks before every step (``is_set()``), and whose
    ``result`` is the call's recorded ``steps``: live (``stop_after = LIVE``) or replayed."""
    return _Counting(inner) if stop_after == LIVE else _StopAfter(stop_after)


@dataclass
class Workers:
    """An executor's result: the engine the learner publishes to (and evaluates with) and the
    rollout workers generating from it; ``close()`` releases them."""

    engine: object
    workers: list
    close: object = field(default=lambda: None)
    parking: bool = False  # the workers can park a generation mid-way, its KV cache kept (hold / release)


class _Hold:
    """The decode loop's hold point (``wait()`` before every step): once asked, the loop parks there
    — its KV cache intact — until released (a publication replaces the weights meanwhile)."""

    def __init__(self):
        self._cond, self._asked, self.parked = threading.Condition(), False, False
        self.on_park = None  # told (outside this lock) when the loop has parked

    def ask(self) -> None:
        with self._cond:
            self._asked = True

    def wait(self) -> None:
        with self._cond:
            if not self._asked:
                return
            self.parked = True
        if self.on_park is not None:
            self.on_park()
        with self._cond:
            self._cond.wait_for(lambda: not self._asked)
            self.parked = False

    def release(self) -> None:
        with self._cond:
            self._asked = False
            self._cond.notify_all()


class LocalWorker:
    """The engine itself, driven from a thread of this process; a stop flag passed to the
    engine's decode loop is the interrupt. ``keep_kv``: a publication instead parks the decode
    loop at its next step (:meth:`hold`, :attr:`parked`, :meth:`release`) and the generation goes
    on over its cache under the new weights (``async.kv_cache: keep``)."""

    def __init__(self, engine, name: str = "rollout-worker-0"):
        self.engine, self.name, self._flag, self._hold, self.keep_kv = engine, name, threading.Event(), _Hold(), False
        self.restarts: int | None = None  # it keeps no count (the collector counts the restarts it makes)

    def generate_requests(self, requests, sampling, stop_after: int | None = LIVE):
        flag = decode_flag(self._flag, stop_after)
        hold = {"hold": self._hold} if self.keep_kv else {}
        return self.engine.generate_requests(requests, sampling, abort=flag, **hold), flag.result

    def interrupt(self) -> None:
        self._flag.set()
        self._hold.release()  # a parked loop must reach its stop check

    def resume(self) -> None:
        self._flag.clear()

    def hold(self, on_park=None) -> None:
        """Park a running generation at its next decode step (``on_park()`` is called once it has)."""
        self._hold.on_park = on_park
        self._hold.ask()

    @property
    def parked(self) -> bool:
        return self._hold.parked

    def release(self) -> None:
        self._hold.release()

    def restart(self) -> None:
        raise WorkerError(f"{self.name}: a thread worker cannot be restarted (its engine lives in the learner's "
                          f"process); use async.executor=ray for workers that survive their process")
