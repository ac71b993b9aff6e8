"""Agent programs in their own process: their CPU work beside the engine's, their crashes not the trainer's.

An agent program's own work — the OpenAI SDK building and parsing every request, its tools, its
bookkeeping — is Python under a GIL. Run in the trainer's process it takes turns with the gateway and
the engine on one core; in an :class:`AgentWorker` (a ``spawn``-ed process, started once per run) it
runs on another core, and a program that segfaults, calls ``os._exit`` or leaks memory fails its
round's episodes, not the run: the worker is started again for the next round.

The parent sends a round — each episode's sample, base URL and key, tagged with the round's id —
and receives one :class:`~hyperrl.agents.programs.EpisodeOutcome` per episode. Rounds run
concurrently (the asynchronous trainer runs a round per prompt group in flight): the child runs each
on a thread of its own, a reader thread of the parent routes every message to its round. Timeouts are
the child's (per episode) and the parent's (the round: every episode's timeout plus a margin, then the
process is killed — and every round it was running fails, named).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["AgentWorker", "AgentPool"]


class AgentWorker:
    """One child process running agent rounds, several at once (see the module doc)."""

    def __init__(self, program: str, *, timeout_s: float, max_concurrent: int, tool_sources: list | None = None):
        self.program, self.timeout_s, self.max_concurrent = program, timeout_s, max_concurrent
        self.tool_sources = list(tool_sources or [])
        self._proc = self._conn = None
        self._lost = False  # a round lost the process: the next start is a restart
        self._closed = False  # closed: no process is started again (a round arriving late fails instead)
        self.restarts = 0
        self._lock = threading.Lock()  # the process, the pipe's sending end, the rounds
        self._rounds: dict[int, tuple[queue.Queue, object]] = {}  # round id → (its messages, its process)
        self._ids = itertools.count()

    def _start(self) -> None:
        """(under the lock) Start the child and the thread reading its messages."""
        ctx = mp.get_context("spawn")  # not fork: the trainer's threads (engine, gateway) hold locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.program, self.timeout_s, self.max_concurrent,
                                                      self.tool_sources),
                                 name="hyperrl-agent", daemon=True)
        self._proc.start()
        child.close()
        threading.Thread(target=self._read, args=(self._conn, self._proc), name="hyperrl-agent-reader",
                         daemon=True).start()

    def _read(self, conn, proc) -> None:
        """Route the child's messages to their rounds; when it is gone, tell the rounds it was running."""
        while True:
            try:
                rid, kind, value = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                box = self._rounds.get(rid)
            if box is not None:
                box[0].put((kind, value))
        with self._lock:
            for q, p in self._rounds.values():
                if p is proc:
                    q.put(("lost", None))

    def run(self, episodes: list[tuple], on_done=None, *, lane: str = "rounds") -> list:
        """``episodes``: ``(sample, base_url, api_key)`` each → their outcomes, in order;
        ``on_done(k)`` as the child reports episode ``k`` returned; ``lane``: the bound the round
        shares (:meth:`ProgramRunner.run`). Safe to call from several threads."""
        from hyperrl.agents.runner import EpisodeOutcome

        with self._lock:
            if self._closed:  # the run is ending: a round still arriving must not start a process nobody stops
                return [EpisodeOutcome(error="the agent processes were closed (the run is ending)")
                        for _ in episodes]
            if self._proc is None or not self._proc.is_alive():
                if self._proc is not None or self._lost:
                    self.restarts += 1
                self._stop()
                self._start()
                self._lost = False
            rid, q, proc = next(self._ids), queue.Queue(), self._proc
            self._rounds[rid] = (q, proc)
            self._conn.send((rid, episodes, lane))
        waves = -(-len(episodes) // max(1, self.max_concurrent))
        deadline = time.monotonic() + waves * self.timeout_s + 60.0  # + the child's start-up (imports)
        got: dict[int, EpisodeOutcome] = {}  # the outcomes already returned: kept if the process dies
        try:
            while time.monotonic() < deadline:
                try:
                    kind, value = q.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    continue
                if kind == "result":
                    return value
                if kind == "lost":
                    break
                k, outcome = value  # "done": one episode's agent returned
                got[k] = outcome
                if on_done is not None:
                    on_done(k)
            proc.join(5 if not proc.is_alive() or time.monotonic() < deadline else 0)
            code = proc.exitcode
            with self._lock:
                if self._proc is proc:
                    self._stop()
                    self._lost = True
            if code is None:  # a hang, not a crash: the round's unfinished episodes fail (a retry would hang too)
                why = f"the agent process did not finish the round within {waves} × env.timeout_s + 60 s; killed"
                return [got.get(k) or EpisodeOutcome(error=why) for k in range(len(episodes))]
            return [got.get(k) or EpisodeOutcome(error=f"the agent process died (exit code {code})", lost=True)
                    for k in range(len(episodes))]
        finally:
            with self._lock:
                self._rounds.pop(rid, None)

    def _stop(self) -> None:
        """(under the lock) Kill the child (if any) and close the pipe."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._conn.close()
            self._proc = None

    def kill(self) -> None:
        """Kill the process now (its rounds end as lost); the next round starts it again."""
        with self._lock:
            self._stop()
            self._lost = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()


class AgentPool:
    """``processes`` :class:`AgentWorker` processes sharing the rounds: each round's episodes are split
    into contiguous slices, one per process, run at once (the SDK's request building and parsing — most
    of an agent episode's CPU — then runs on every core the trainer leaves idle); rounds smaller than the
    pool (an asynchronous run's prompt groups) start at the next process in turn."""

    def __init__(self, program: str, *, processes: int, timeout_s: float, max_concurrent: int,
                 tool_sources: list | None = None):
        if processes < 1:
            raise ValueError(f"env.workers={processes}: at least one agent process")
        per = max(1, -(-max_concurrent // processes))  # the bound on episodes at once, shared out
        self.workers = [AgentWorker(program, timeout_s=timeout_s, max_concurrent=per, tool_sources=tool_sources)
                        for _ in range(processes)]
        self._turn = itertools.count()  # which process a round's first slice goes to

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def run(self, episodes: list[tuple], on_done=None, *, lane: str = "rounds") -> list:
        """As :meth:`AgentWorker.run`: the outcomes of ``episodes`` in order (``on_done(k)`` with ``k``
        the index in ``episodes``)."""
        k, first = min(len(self.workers), len(episodes)), next(self._turn)
        if k <= 1:
            return self.workers[first % len(self.workers)].run(episodes, on_done, lane=lane)
        cuts = [len(episodes) * i // k for i in range(k + 1)]

        def part(i: int) -> list:
            a = cuts[i]
            done = None if on_done is None else (lambda j: on_done(a + j))
            return self.workers[(first + i) % len(self.workers)].run(episodes[a:cuts[i + 1]], done, lane=lane)

        with ThreadPoolExecutor(k, thread_name_prefix="hyperrl-agent-pool") as pool:
            return [o for out in pool.map(part, range(k)) for o in out]

    def kill(self) -> None:
        """Kill every agent process now (:meth:`AgentWorker.kill`)."""
        for w in self.workers:
            w.kill()

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _serve(conn, program: str, timeout_s: float, max_concurrent: int, tool_sources: list) -> None:
    """The child: load the program (and start its tools' MCP servers) once, then run each round sent
    — on a thread of its own, several at once — until the pipe closes."""
    from hyperrl.agents.mcp import Toolbox
    from hyperrl.agents.runner import EpisodeOutcome, ProgramRunner

    guard_process()
    try:
        agent = ProgramRunner(program, timeout_s=timeout_s, max_concurrent=max_concurrent)
        agent.toolbox = Toolbox(tool_sources) if tool_sources and agent.wants_tools else None
    except Exception as e:  # noqa: BLE001 - every episode of every round fails with the reason
        agent, error = None, f"{type(e).__name__}: {e}"
    lock = threading.Lock()  # the pipe is shared by the rounds' and the episodes' threads

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    busy = [0]  # rounds running: when none is, what the agents started is ended

    def round_(rid, episodes, lane) -> None:
        try:
            send((rid, "result", agent.run(episodes, lambda k, o: send((rid, "done", (k, o))), lane=lane)))
        finally:
            with lock:
                busy[0] -= 1
                if not busy[0]:
                    end_descendants()

    while True:
        try:
            rid, episodes, lane = conn.recv()
        except (EOFError, OSError):
            end_descendants()
            return
        if agent is None:
            send((rid, "result", [EpisodeOutcome(error=error) for _ in episodes]))
        else:
            with lock:
                busy[0] += 1
            threading.Thread(target=round_, args=(rid, episodes, lane), daemon=True).start()


def guard_process() -> None:
    """(in an agent process) Adopt what the agents start and die with the trainer: the process becomes a child
    subreaper (Linux ``PR_SET_CHILD_SUBREAPER``: a daemon an agent starts — ``setsid``, a double fork — is
    re-parented here, not to init, so :func:`end_descendants` finds it), and a watchdog thread ends the process
    and every descendant when its parent is gone (``kill -9`` of the trainer: its parent id changes) — a thread, not
    ``PR_SET_PDEATHSIG``, which fires when the *thread* that started the process ends."""
    import ctypes
    import os

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass  # not Linux: descendants in other sessions are not adopted

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        end_descendants()
        os._exit(1)

    threading.Thread(target=watch, name="hyperrl-agent-watchdog", daemon=True).start()


def end_descendants() -> None:
    """SIGKILL every live descendant of this process (read from ``/proc``; nothing where there is none) but the
    run's own — an MCP server (``HYPERRL_KEEP`` in its environment) and what it started — scanning again until
    none is left (a process forking as it is scanned), and reap the direct children it ended."""
    import os
    import signal

    me = os.getpid()
    for _ in range(50):
        live, dead = _descendants(me)
        for pid in dead:  # ours to reap (this process is their subreaper); a Popen's own wait is not disturbed:
            try:          # only the pids this function killed end up here
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


def _descendants(me: int) -> tuple[list[int], list[int]]:
    """(live descendants of ``me`` outside the kept subtrees, zombie children of ``me``)."""
    import os

    from hyperrl.agents.mcp import KEEP_MARK

    def kept(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return any(v.startswith(f"{KEEP_MARK}=".encode()) for v in f.read().split(b"\0"))
        except OSError:
            return False

    children: dict[int, list[tuple[int, str]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return [], []
    for d in names:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                children.setdefault(int(ppid), []).append((int(d), state))
            except (OSError, IndexError, ValueError):
                continue
    live, dead = [], [pid for pid, state in children.get(me, []) if state == "Z"]
    todo = [pid for pid, state in children.get(me, []) if state != "Z"]
    while todo:
        pid = todo.pop()
        if kept(pid):
            continue
        live.append(pid)
        todo.extend(p for p, st in children.get(pid, []) if st != "Z")
    return live, dead
