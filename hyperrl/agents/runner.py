"""Running an agent program on a round of episodes, in whatever process it lives in.

A :class:`ProgramRunner` runs ``solve(sample, client[, tools])`` on each ``(sample, base_url,
api_key)``: an ``async def`` on one event loop (the runner's, shared by the rounds that run at once —
the asynchronous trainer runs a round per prompt group in flight) with ``openai.AsyncOpenAI`` clients
over shared connection pools and one bound on the episodes running (``max_concurrent``), a plain function
on threads with ``openai.OpenAI`` clients — each bound to its episode, sharing a few connection pools —
every episode bounded by ``timeout_s``, a failure an :class:`EpisodeOutcome` with the traceback's tail,
never an exception. The trainer's process uses it directly (``env.isolate: false``), an agent process
(:mod:`hyperrl.agents.worker`) in the child.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hyperrl.rewards import load_function

__all__ = ["AgentResult", "EpisodeOutcome", "ProgramRunner", "outcome_of", "positional_params"]


@dataclass(frozen=True)
class AgentResult:
    """What an agent program may return: its ``reward`` (None: the configured rewards score it),
    ``success`` (the task solved, whatever shaping adds: the success rate) and ``info``."""

    reward: float | None = None
    success: bool | None = None
    info: dict = field(default_factory=dict)


@dataclass
class EpisodeOutcome:
    """One episode as the runner saw it: its rows' reward, success, and the failure (None: none)."""

    reward: float | None = None
    success: bool | None = None
    error: str | None = None
    lost: bool = False  # the agent process died under it (not its own failure): retried once in a fresh process


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "…" + text[-n:]


class ProgramRunner:
    """The program ``ref`` (``"file.py:function"``) run on rounds of episodes (see the module doc).
    ``toolbox``: the run's tools for a program taking a third parameter."""

    def __init__(self, ref: str, *, timeout_s: float, max_concurrent: int, toolbox=None):
        self.program = load_function(ref, "env.program")
        self.timeout_s, self.max_concurrent, self.toolbox = timeout_s, max_concurrent, toolbox
        self.is_async = inspect.iscoroutinefunction(self.program)
        self.wants_tools = positional_params(self.program) >= 3
        self._lock = threading.Lock()
        self._aloop = None  # the async programs' event loop (lazy)
        self._lanes: dict[str, tuple] = {}  # lane → its bound and HTTP pools (made on the loop)
        self.cancel = threading.Event()  # set: the episodes under way are abandoned now (the run is stopping)

    def run(self, episodes: list[tuple], on_done=None, *, lane: str = "rounds") -> list[EpisodeOutcome]:
        """Run the program on ``episodes`` — ``(sample, base_url, api_key)`` each — in this process:
        an ``async def`` on one event loop, a plain function on threads; one outcome each, in order.
        ``on_done(k, outcome)`` is called as episode ``k`` returns (the gateway then stops waiting for it when
        it batches the others' calls; an agent process sends its outcome at once). Concurrent rounds of one
        ``lane`` share the bound of ``max_concurrent`` episodes and the HTTP pools; lanes are apart — an
        evaluation (lane ``rounds``) run while the asynchronous trainer's units (lane ``units``) wait paused never
        waits for their slots or connections."""
        done = on_done or (lambda k, outcome: None)
        if self.is_async:
            coro = self._run_async(episodes, done, lane)
            return asyncio.run_coroutine_threadsafe(coro, self._loop()).result()
        import openai

        def one(k):
            out = EpisodeOutcome(error="the agent's thread ended without an outcome")
            try:
                out = self._run_one(*episodes[k], http[k % len(http)])
                return out
            finally:
                done(k, out)

        http = [openai.DefaultHttpxClient(limits=_limits()) for _ in range(_pools(self.max_concurrent))]
        try:
            with ThreadPoolExecutor(max(1, min(self.max_concurrent, len(episodes)))) as pool:
                return list(pool.map(one, range(len(episodes))))
        finally:
            for h in http:
                h.close()

    def _run_one(self, sample, base_url: str, api_key: str, http=None) -> EpisodeOutcome:
        from openai import OpenAI

        try:
            client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s, http_client=http)
        except Exception as e:  # noqa: BLE001 - a failure of this episode, never of the step
            return EpisodeOutcome(error=f"{type(e).__name__}: {e}")
        box: dict[str, Any] = {}

        def call():
            try:
                box["value"] = self.program(sample, client, *self._tools())
            except BaseException as e:  # noqa: BLE001 - reported as the episode's failure
                box["error"] = "".join(traceback.format_exception(e))

        t = threading.Thread(target=call, daemon=True)  # a hung agent is left behind, its episode closed
        t.start()
        end = time.monotonic() + self.timeout_s
        while t.is_alive() and time.monotonic() < end and not self.cancel.is_set():
            t.join(min(0.2, max(0.0, end - time.monotonic())))
        if t.is_alive():  # left behind: once its episode is finished its calls get 404
            return EpisodeOutcome(error="cancelled" if self.cancel.is_set() else f"timed out after {self.timeout_s}s")
        if "error" in box:
            return EpisodeOutcome(error=_tail(box["error"]))
        return self._outcome(box.get("value"))

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The async programs' event loop, on a daemon thread (started on first use)."""
        with self._lock:
            if self._aloop is None:
                self._aloop = asyncio.new_event_loop()
                threading.Thread(target=self._aloop.run_forever, name="hyperrl-agent-loop", daemon=True).start()
            return self._aloop

    async def _run_async(self, episodes, done, lane: str) -> list[EpisodeOutcome]:
        import openai

        if lane not in self._lanes:  # on the runner's loop: one bound and one set of pools per lane (an
            # episode waiting on a paused call holds its connection: a lane of its own keeps the others')
            self._lanes[lane] = (asyncio.Semaphore(max(1, self.max_concurrent)),
                                 [openai.DefaultAsyncHttpxClient(limits=_limits())
                                  for _ in range(_pools(self.max_concurrent))])
        gate, http = self._lanes[lane]

        async def one(k, sample, base_url, api_key):
            out = EpisodeOutcome(error="the episode was cancelled")
            try:
                out = await run(k, sample, base_url, api_key)
                return out
            finally:
                done(k, out)

        async def run(k, sample, base_url, api_key):
            async with gate:
                client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                            timeout=self.timeout_s, http_client=http[k % len(http)])
                try:
                    value = await asyncio.wait_for(self.program(sample, client, *self._tools()), self.timeout_s)
                    return self._outcome(value)
                except TimeoutError:
                    return EpisodeOutcome(error=f"timed out after {self.timeout_s}s")
                except Exception as e:  # noqa: BLE001 - the episode's failure
                    return EpisodeOutcome(error=_tail("".join(traceback.format_exception(e))))

        return list(await asyncio.gather(*(one(k, *e) for k, e in enumerate(episodes))))

    def _tools(self) -> tuple:
        """``(toolbox,)`` for a program taking ``tools``, else ()."""
        if not self.wants_tools:
            return ()
        if self.toolbox is None:
            raise ValueError("env.program takes tools (sample, client, tools) but no tools: are configured")
        return (self.toolbox,)

    def _outcome(self, value) -> EpisodeOutcome:
        return outcome_of(value)


def outcome_of(value) -> EpisodeOutcome:
    """What a program (or a CLI agent's judge) returned, as an outcome: a number, an :class:`AgentResult`,
    or None (the configured rewards decide); anything else is the episode's failure, named."""
    if isinstance(value, AgentResult):
        return EpisodeOutcome(None if value.reward is None else float(value.reward), value.success)
    if value is None:
        return EpisodeOutcome()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return EpisodeOutcome(error=f"the program returned {type(value).__name__}; return a number, an "
                                    "AgentResult or None")
    return EpisodeOutcome(float(value))


def positional_params(fn) -> int:
    """How many positional parameters ``fn`` takes."""
    params = inspect.signature(fn).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


_POOL = 32  # connections per HTTP client


def _pools(concurrent: int) -> int:
    """HTTP clients for ``concurrent`` episodes: shared (a client each would build an SSL context each,
    ≈ 5 ms), several of :data:`_POOL` connections, at most 4 — the ``httpx`` pool scans every connection
    each time a response ends, so one pool of 512 connections costs more than the requests it serves,
    while more requests in flight than the gateway batches well only queue there (a step of 512 episodes
    here: 1.45 s with 4 × 32, 1.9 s with 16 × 32, 2.9 s with 1 × 512)."""
    return max(1, min(-(-concurrent // _POOL), 4))


def _limits():
    """A pool of :data:`_POOL` connections, in the HTTP package this ``openai`` uses (``httpx``, or its
    fork ``httpx2`` in openai ≥ 3)."""
    import importlib

    import openai

    http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])
    return http.Limits(max_connections=_POOL, max_keepalive_connections=_POOL)


