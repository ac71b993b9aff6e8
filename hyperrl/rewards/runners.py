"""Where a reward's calls run (``rewards[].workers`` / ``pool``), each call within its deadline, retried, its
failure an :class:`Outcome` — never an exception on the caller's thread.

A reward style cuts a batch into :class:`Call` s (one per row, or chunks of rows for a batch-style reward); a
runner turns each call into a future of its :class:`Outcome`, so the caller can submit a step's calls — every
reward's, every group's — and collect them later (scoring overlapped with generation):

* ``inline`` (``workers: 0``, the default): on the caller's thread, one after another, the deadline a ``SIGALRM``
  on the main thread — what hyperrl always did;
* ``thread`` (``workers: N``): N threads — for rewards that wait (a sandbox, a server). A thread cannot be stopped:
  a call past its deadline is reported and its result dropped, the thread runs on until the function returns;
* ``process`` (``workers: N, pool: process``; :mod:`hyperrl.rewards.processes`): N worker processes, started once,
  each building the reward from its recipe — CPU-bound rewards (math-verify) run beside the trainer instead of on
  its interpreter lock, and a reward process cannot touch the trainer's memory. A call past its deadline kills its
  worker's process group; a worker that dies is restarted; the call is reported either way;
* ``async def`` rewards: coroutines on one event loop thread, at most ``workers`` (default 32) in flight, the
  deadline ``asyncio.wait_for``'s.

:func:`submit` adds the retries (``retries``, with a doubling back-off from 0.1 s, at most 2 s) around any runner.
Why not ``concurrent.futures.ProcessPoolExecutor`` or pebble: under spawn / forkserver every worker re-imports the
user's main script (a script without a ``__main__`` guard starts workers recursively), fork is unsafe in a process
holding torch's threads, and the standard pool cannot stop one call nor survive one worker's death. Here a worker
is ``python -m hyperrl.rewards.worker`` over a pipe: nothing of the caller is re-imported.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

from hyperrl.errors import HyperRLError
from hyperrl.registry import Registry

__all__ = ["Call", "Outcome", "Finished", "RUNNERS", "Runner", "submit", "raised_outcome", "WorkerStartError"]


class Call(NamedTuple):
    """One call of a reward function: the ``rows`` (indices into the rows the reward scores) it returns values
    for, and its arguments (``kwargs``: read, never changed — calls may share one dict). (A named tuple: the default
    job makes 1,024 a step.)"""

    rows: tuple[int, ...]
    args: tuple = ()
    kwargs: dict = {}  # noqa: RUF012 - never mutated (see above)


@dataclass(frozen=True)
class Outcome:
    """What one call came to: its ``value``, or — ``failure`` set — why it has none (``kind``: ``raised`` |
    ``timeout`` | ``died`` | ``invalid``; ``error``: the user's exception, when it ran in this process);
    ``attempts``: calls made (1 + retries used)."""

    value: Any = None
    failure: str | None = None
    kind: str | None = None
    attempts: int = 1
    error: BaseException | None = None


class WorkerStartError(HyperRLError, RuntimeError):
    """A reward's worker process could not start or rebuild the reward (the message carries its error)."""


class Runner(ABC):
    """Runs one reward's calls: ``start(call) -> Future[Outcome]`` (one attempt, within ``timeout_s``), and
    ``close()``."""

    synchronous = False  # start() runs the call before returning (its retries too, on the caller's thread)

    def __init__(self, fn, *, workers: int, timeout_s: float | None, recipe=None, name: str = "reward"):
        self.fn, self.workers, self.timeout_s, self.name = fn, workers, timeout_s, name

    @abstractmethod
    def start(self, call: Call) -> Future:
        """One attempt of ``call``: a future of its :class:`Outcome` (never an exception)."""

    def close(self) -> None:  # noqa: B027 - a runner with nothing to release (inline, async) keeps this
        """Release threads and processes (idempotent)."""


RUNNERS: Registry = Registry("reward runner")


class _Threads:
    """``n`` daemon threads running submitted functions (``concurrent.futures``' threads are joined at exit: one
    stuck in a reward that never returns would keep the finished trainer from exiting)."""

    def __init__(self, n: int, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.n, self.name, self.lock, self.retiring = n, name, threading.Lock(), set()
        for k in range(n):
            threading.Thread(target=self._serve, name=f"{name}-{k}", daemon=True).start()

    def _serve(self):
        while (job := self.jobs.get()) is not None:
            fn, args, out = job
            try:
                out.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting side
                out.set_exception(e)
            with self.lock:  # a thread that came back after a replacement was started for it retires (that thread
                if threading.get_ident() in self.retiring:  # itself: not the replacement, which serves on)
                    self.retiring.discard(threading.get_ident())
                    return

    def replace(self, stuck: int) -> None:
        """The thread ``stuck`` (its ident) is in a call past its deadline: start another, so the pool keeps ``n``
        serving (the stuck one retires when it returns)."""
        with self.lock:
            self.retiring.add(stuck)
        threading.Thread(target=self._serve, name=f"{self.name}-spare", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        out: Future = Future()
        self.jobs.put((fn, args, out))
        return out

    def shutdown(self) -> None:
        for _ in range(self.n):
            self.jobs.put(None)


def raised_outcome(e: BaseException) -> Outcome:
    """A call that raised; a hyperrl error (a reward naming bad input: a row without tests) is ``invalid`` — never
    retried, never abstained on."""
    kind = "invalid" if isinstance(e, HyperRLError) else "raised"
    return Outcome(failure=f"raised {type(e).__name__}: {e}", kind=kind, error=e)


class Finished:
    """A call already run (inline, or retried on the caller's thread): the part of ``concurrent.futures.Future``
    the caller uses — ``result``, ``done``, ``add_done_callback`` (called at once) — without its condition
    variable. A finished ``Future`` costs two locked ``set_result`` / ``result`` rounds a call: ≈ 18 ms a step of
    the default job (512 rows × 2 per-row rewards), a sixth of its step."""

    __slots__ = ("_outcome",)

    def __init__(self, outcome: Outcome):
        self._outcome = outcome

    def result(self, timeout: float | None = None) -> Outcome:
        """The outcome (never waits)."""
        return self._outcome

    def done(self) -> bool:
        """Always: the call has run."""
        return True

    def add_done_callback(self, fn) -> None:
        """``fn(self)`` now, as a finished ``Future`` does."""
        fn(self)


def _done(o: Outcome) -> Finished:
    return Finished(o)


class _Deadline(BaseException):  # not an Exception: the user's `except Exception` cannot swallow it
    pass


def _fire(signum, frame):
    raise _Deadline()


@RUNNERS.register("inline")
class InlineRunner(Runner):
    """On the caller's thread, now (``start`` returns a finished future)."""

    synchronous = True

    def _late(self) -> Outcome:
        return Outcome(failure=f"did not return within rewards[].timeout_s={self.timeout_s} s; it was stopped",
                       kind="timeout")

    def start(self, call):
        values, failed = self.run_all([call])
        return _done(failed[0] if failed else Outcome(values[0]))

    def run_all(self, calls: list[Call]) -> tuple[list, dict[int, Outcome]]:
        """Every call now, one after another, each within ``timeout_s``: the values (None where a call failed) and
        the failed calls' outcomes by index; :meth:`start` is its one-call case. The deadline is ``SIGALRM`` through a
        real-time interval timer, its handler installed once a pass — on the main thread, where Python delivers
        signals (elsewhere no limit can be enforced in-process and none is set); Python code and sleeps are
        interrupted, a C extension that never returns to the interpreter is not (use ``pool: process``). No future
        and no outcome per successful call: at the default job's 1,024 calls a step the per-call path was ≈ 3 ms of
        its ≈ 5 ms of scoring."""
        values, failed = [], {}
        seconds = self.timeout_s if self.timeout_s and threading.current_thread() is threading.main_thread() else None
        old = signal.signal(signal.SIGALRM, _fire) if seconds else None
        try:
            for i, c in enumerate(calls):
                v = None
                try:
                    if seconds:
                        if signal.getsignal(signal.SIGALRM) is not _fire:  # a call replaced it (a reward's own
                            signal.signal(signal.SIGALRM, _fire)  # alarm): the deadline's again, as each call had
                        signal.setitimer(signal.ITIMER_REAL, seconds)
                    try:
                        v = self.fn(*c.args, **c.kwargs)
                    finally:
                        if seconds:
                            signal.setitimer(signal.ITIMER_REAL, 0)
                except _Deadline:  # also when it fired as the call returned: the call timed out
                    v, failed[i] = None, self._late()
                except Exception as e:  # noqa: BLE001 - any failure of user code is the call's outcome
                    v, failed[i] = None, raised_outcome(e)
                values.append(v)  # exactly one value a call: rows never shift
        finally:
            if seconds:
                signal.signal(signal.SIGALRM, old)
        return values, failed


def _first(f: Future, o: Outcome) -> bool:
    """Set ``f`` to ``o`` unless it is set already (the deadline or the result came first); True when it was."""
    try:
        f.set_result(o)
        return True
    except Exception:  # noqa: BLE001 - InvalidStateError: the other came first
        return False


@RUNNERS.register("thread")
class ThreadRunner(Runner):
    """``workers`` threads; a call's deadline starts when a thread takes it."""

    def __init__(self, fn, *, workers, timeout_s, recipe=None, name="reward"):
        super().__init__(fn, workers=workers, timeout_s=timeout_s, name=name)
        self.pool = _Threads(workers, "hyperrl-reward")

    def start(self, call):
        out: Future = Future()

        def late(stuck: int):
            if _first(out, Outcome(failure=f"did not return within rewards[].timeout_s={self.timeout_s} s (a thread "
                                   "cannot be stopped: its result is dropped; use pool: process for a reward that can "
                                   "hang)", kind="timeout")):
                self.pool.replace(stuck)

        def run():
            timer = None
            if self.timeout_s:
                timer = threading.Timer(self.timeout_s, late, (threading.get_ident(),))
                timer.daemon = True
                timer.start()
            try:
                _first(out, Outcome(self.fn(*call.args, **call.kwargs)))
            except BaseException as e:  # noqa: BLE001 - SystemExit too: the call's failure
                _first(out, raised_outcome(e))
            finally:
                if timer is not None:
                    timer.cancel()

        self.pool.submit(run)
        return out

    def close(self):
        self.pool.shutdown()


class _Loop:
    """The one event loop thread every ``async def`` reward of the process shares."""

    _lock, _loop = threading.Lock(), None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="hyperrl-reward-loop", daemon=True).start()
                cls._loop = loop
            return cls._loop


@RUNNERS.register("async")
class AsyncRunner(Runner):
    """An ``async def`` reward: coroutines on the shared loop, at most ``workers`` in flight."""

    def __init__(self, fn, *, workers, timeout_s, recipe=None, name="reward"):
        super().__init__(fn, workers=workers, timeout_s=timeout_s, name=name)
        self.loop = _Loop.get()
        self.sem = asyncio.run_coroutine_threadsafe(self._sem(max(workers, 1)), self.loop).result()

    @staticmethod
    async def _sem(n):
        return asyncio.Semaphore(n)

    async def _one(self, call):
        async with self.sem:
            try:
                return Outcome(await asyncio.wait_for(self.fn(*call.args, **call.kwargs), self.timeout_s))
            except asyncio.TimeoutError:
                return Outcome(failure=f"did not return within rewards[].timeout_s={self.timeout_s} s; it was "
                               "cancelled", kind="timeout")
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - SystemExit too: never the shared loop's end
                return raised_outcome(e)

    def start(self, call):
        return asyncio.run_coroutine_threadsafe(self._one(call), self.loop)


def submit(runner: Runner, call: Call, retries: int = 0) -> Future:
    """A future of ``call``'s :class:`Outcome` on ``runner``, a failed call retried up to ``retries`` times (back-off
    0.1 s, doubling, at most 2 s); the outcome counts its attempts."""
    if runner.synchronous:
        for k in range(retries + 1):
            o = runner.start(call).result()
            if o.failure is None or k == retries or o.kind == "invalid":
                return _done(Outcome(o.value, o.failure, o.kind, k + 1, o.error))
            time.sleep(min(0.1 * 2 ** k, 2.0))
    out: Future = Future()

    def attempt(k: int) -> None:
        def done(f: Future) -> None:
            try:
                o = f.result()
            except BaseException as e:  # noqa: BLE001 - a runner's own failure: still this call's outcome
                o = raised_outcome(e)
            if o.failure is None or k >= retries or o.kind == "invalid":
                out.set_result(Outcome(o.value, o.failure, o.kind, k + 1, o.error))
                return
            t = threading.Timer(min(0.1 * 2 ** k, 2.0), attempt, (k + 1,))
            t.daemon = True
            t.start()

        runner.start(call).add_done_callback(done)

    attempt(0)
    return out
