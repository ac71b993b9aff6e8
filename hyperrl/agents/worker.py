"""Agent programs in their own process: their CPU work beside the engine's, their crashes not the trainer's.

An agent program's own work — the OpenAI SDK building and parsing every request, its tools, its
bookkeeping — is Python under a GIL. Run in the trainer's process it takes turns with the gateway and
the engine on one core; in an :class:`AgentWorker` (a ``spawn``-ed process, started once per run) it
runs on another core, and a program that segfaults, calls ``os._exit`` or leaks memory fails its
round's episodes, not the run: the worker is started again for the next round.

The parent sends a round — the program's ``"file.py:function"``, each episode's sample, base URL and
key — and receives one :class:`~hyperrl.agents.programs.EpisodeOutcome` per episode. Timeouts are the
child's (per episode) and the parent's (the round: every episode's timeout plus a margin, then the
worker is killed and the episodes still out fail).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

__all__ = ["AgentWorker"]


class AgentWorker:
    """One child process running agent rounds (see the module doc)."""

    def __init__(self, program: str, *, timeout_s: float, max_concurrent: int, tool_sources: list | None = None):
        self.program, self.timeout_s, self.max_concurrent = program, timeout_s, max_concurrent
        self.tool_sources = list(tool_sources or [])
        self._proc = None
        self._lost = False  # the last round lost the process: the next start is a restart
        self.restarts = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # not fork: the trainer's threads (engine, gateway) hold locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.program, self.timeout_s, self.max_concurrent,
                                                                 self.tool_sources),
                                 name="hyperrl-agent", daemon=True)
        self._proc.start()
        child.close()

    def run(self, episodes: list[tuple], on_done=None) -> list:
        """``episodes``: ``(sample, base_url, api_key)`` each → their outcomes, in order;
        ``on_done(k)`` as the child reports episode ``k`` returned."""
        from hyperrl.agents.runner import EpisodeOutcome

        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None or self._lost:
                self.restarts += 1
            self._start()
            self._lost = False
        self._conn.send(episodes)
        waves = -(-len(episodes) // max(1, self.max_concurrent))
        deadline = time.monotonic() + waves * self.timeout_s + 60.0  # + the child's start-up (imports)
        while time.monotonic() < deadline:
            if self._conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    kind, value = self._conn.recv()
                except (EOFError, OSError):
                    break
                if kind == "result":
                    return value
                if on_done is not None:  # "done": one episode's agent returned
                    on_done(value)
                continue
            if not self._proc.is_alive():
                break
        self._proc.join(5 if not self._proc.is_alive() or time.monotonic() < deadline else 0)
        code = self._proc.exitcode
        self.close()
        self._lost = True
        why = (f"the agent process died (exit code {code})" if code is not None else
               f"the agent process did not finish the round within {waves} × env.timeout_s + 60 s; killed")
        return [EpisodeOutcome(error=why) for _ in episodes]

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._conn.close()
            self._proc = None


def _serve(conn, program: str, timeout_s: float, max_concurrent: int, tool_sources: list) -> None:
    """The child: load the program (and start its tools' MCP servers) once, then run each round sent
    until the pipe closes."""
    from hyperrl.agents.mcp import Toolbox
    from hyperrl.agents.runner import EpisodeOutcome, ProgramRunner

    try:
        agent = ProgramRunner(program, timeout_s=timeout_s, max_concurrent=max_concurrent)
        agent.toolbox = Toolbox(tool_sources) if tool_sources and agent.wants_tools else None
    except Exception as e:  # noqa: BLE001 - every episode of every round fails with the reason
        agent, error = None, f"{type(e).__name__}: {e}"
    while True:
        try:
            episodes = conn.recv()
        except (EOFError, OSError):
            return
        if agent is None:
            conn.send(("result", [EpisodeOutcome(error=error) for _ in episodes]))
        else:
            lock = threading.Lock()

            def done(k, lock=lock):
                with lock:  # the pipe is shared by the episodes' threads
                    conn.send(("done", k))

            outcomes = agent.run(episodes, done)
            with lock:
                conn.send(("result", outcomes))
