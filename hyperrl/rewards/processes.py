"""The ``process`` reward runner (``rewards[].pool: process``): ``workers`` worker processes
(``python -m hyperrl.rewards.worker``, :mod:`hyperrl.rewards.worker`) over pipes, each rebuilding the reward from its
recipe; a call past its deadline kills its worker's process group, a worker that dies is restarted, the call is
reported either way. The message framing (length-prefixed pickles both ways: both ends are the trainer's own code —
the reward's *values* come back from the user's function) is :func:`send_message` / :func:`read_message`. Why not
``concurrent.futures`` or pebble: see :mod:`hyperrl.rewards.runners`.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import time

from hyperrl.errors import HyperRLError
from hyperrl.rewards.runners import RUNNERS, Call, Outcome, Runner, WorkerStartError, _Threads, raised_outcome

__all__ = ["ProcessRunner", "send_message", "send_bytes", "read_message", "read_bytes"]


def send_message(fd: int, obj) -> None:
    """Write one length-prefixed pickle to ``fd``."""
    send_bytes(fd, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def send_bytes(fd: int, data: bytes) -> None:
    """Write ``data`` length-prefixed to ``fd``."""
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd`` (None: end of file); ``TimeoutError`` past ``deadline`` (``time.monotonic``)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_message(fd: int, deadline: float | None = None):
    """One length-prefixed pickle from ``fd``; ``EOFError`` when it is closed, ``TimeoutError`` past ``deadline``."""
    return pickle.loads(read_bytes(fd, deadline))


def read_bytes(fd: int, deadline: float | None = None) -> bytes:
    """One length-prefixed message's bytes from ``fd`` (``EOFError``, ``TimeoutError`` as :func:`read_message`)."""
    head = _read_exact(fd, 8, deadline)
    if head is None:
        raise EOFError
    body = _read_exact(fd, struct.unpack("<Q", head)[0], deadline)
    if body is None:
        raise EOFError
    return body


class _Worker:
    """One worker process (``python -m hyperrl.rewards.worker``), its own session (a deadline kills its whole
    process group), holding the reward its recipe builds."""

    START_S = 300.0  # importing and building a reward (a model) may take a while

    def __init__(self, recipe: bytes, name: str, env: dict | None = None):
        r_in, w_in = os.pipe()  # parent → worker
        r_out, w_out = os.pipe()  # worker → parent
        self.proc = subprocess.Popen([sys.executable, "-m", "hyperrl.rewards.worker", str(r_in), str(w_out),
                                      str(os.getpid())],
                                     pass_fds=(r_in, w_out), stdin=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, **(env or {}),
                                          "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        os.close(r_in)
        os.close(w_out)
        self.to, self.frm, self.name, self.started, self.env = w_in, r_out, name, False, env
        send_message(self.to, recipe)

    def ready(self) -> _Worker:
        """Wait for the worker to have built the reward (a :class:`WorkerStartError` naming what went wrong)."""
        try:
            status, detail = read_message(self.frm, time.monotonic() + self.START_S)
        except (EOFError, TimeoutError, OSError) as e:
            self.kill()
            raise WorkerStartError(f"reward {self.name!r}: its worker process did not start ({type(e).__name__}; "
                                   f"exit code {self.proc.returncode}) — see its stderr above") from None
        if status != "ready":
            self.kill()
            raise WorkerStartError(f"reward {self.name!r}: its worker process could not rebuild it: {detail} — a "
                                   "reward for pool: process must be importable there (a file's function: fn: "
                                   "path/to/file.py:name; a registered one: registered by an importable module)")
        self.started = True
        return self

    def call(self, call: Call, timeout_s: float | None) -> Outcome:
        deadline = None if not timeout_s else time.monotonic() + timeout_s
        try:
            data = pickle.dumps((call.args, call.kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - nothing was sent: the worker is as it was
            return Outcome(failure=f"raised {type(e).__name__} while its arguments were sent to a worker process: "
                           f"{e}", kind="raised", error=e)
        try:
            send_bytes(self.to, data)
            raw = read_bytes(self.frm, deadline)
        except TimeoutError:
            self.kill()
            return Outcome(failure=f"did not return within rewards[].timeout_s={timeout_s} s; its worker process "
                           "was killed (and restarted)", kind="timeout")
        except (EOFError, OSError):
            self.kill()
            return Outcome(failure=f"failed: its worker process died (exit code {self.proc.returncode}; restarted) "
                           "— see its stderr above", kind="died")
        try:
            status, detail = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - e.g. a value of a class the trainer cannot import
            return Outcome(failure=f"raised {type(e).__name__} while its result was read back from its worker "
                           f"process: {e} (return plain numbers, lists and dicts)", kind="raised", error=e)
        if status == "ok":
            return Outcome(detail)
        if status == "invalid":  # the reward named bad input (and maybe its row): raised as the reward's own error
            err = HyperRLError(detail[0].partition(": ")[2])
            err.row = detail[1]
            return Outcome(failure=f"raised {detail[0]}", kind="invalid", error=err)
        return Outcome(failure=f"raised {detail}", kind="raised")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for fd in (self.to, self.frm):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.to = self.frm = -1


def _uid_envs(workers: int) -> list[dict]:
    """Each worker process's own block of 64 sandbox uids (:func:`hyperrl.sandbox.allocate_uids` of this process):
    a code reward in a worker runs sandboxes whose process limit no other process shares."""
    from hyperrl.sandbox import allocate_uids

    block = allocate_uids(64 * workers)
    return [{"HYPERRL_SANDBOX_UID_BASE": str(block[64 * k])} for k in range(workers)]


@RUNNERS.register("process")
class ProcessRunner(Runner):
    """``workers`` worker processes, started here (each must rebuild the reward from ``recipe`` — its failure a
    :class:`WorkerStartError` now, at load); a killed or dead worker is replaced before its next call."""

    def __init__(self, fn, *, workers, timeout_s, recipe=None, name="reward"):
        super().__init__(fn, workers=workers, timeout_s=timeout_s, name=name)
        if recipe is None:
            raise WorkerStartError(f"reward {name!r}: pool: process needs the reward's recipe")
        self.recipe, self.name, self.idle, self.closed = recipe, name, queue.Queue(), False
        # side by side (each imports torch), each with its own block of sandbox uids
        started, errors = [_Worker(recipe, name, env) for env in _uid_envs(workers)], []
        self.every = list(started)  # every worker process ever started (close ends those still alive)
        for w in started:
            try:
                self.idle.put(w.ready())
            except WorkerStartError as e:
                errors.append(e)
        if errors:
            self.close()
            raise errors[0]
        self.pool = _Threads(workers, "hyperrl-reward-proc")
        self.restarts = 0

    def _run(self, call) -> Outcome:
        if self.closed:
            return Outcome(failure="failed: the reward's worker processes were closed", kind="died")
        w = self.idle.get()
        try:
            if not w.started:
                w.ready()
            return w.call(call, self.timeout_s)
        except WorkerStartError as e:
            return Outcome(failure=f"failed: its worker process could not be restarted: {e}", kind="died")
        except Exception as e:  # noqa: BLE001 - whatever happens here is this call's outcome, never a lost slot
            return raised_outcome(e)
        finally:
            if self.closed:
                w.kill()
            elif not w.alive:  # killed past its deadline, or died: its replacement starts now, in the background
                try:
                    fresh = _Worker(self.recipe, self.name, w.env)
                    self.every.append(fresh)
                    self.restarts += 1
                    w = fresh
                except Exception:  # noqa: BLE001, S110 - the next call tries again (and reports it)
                    pass
            self.idle.put(w)

    def start(self, call):
        return self.pool.submit(self._run, call)

    def close(self):
        self.closed = True
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown()
        for w in getattr(self, "every", ()):
            if w.alive:
                w.kill()
            else:
                w.close_pipes()
