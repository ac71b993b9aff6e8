"""MCP tools: the tools of a Model Context Protocol server over stdio as hyperrl :class:`~hyperrl.envs.Tool` s.

``tools: [{mcp: ["python", "-m", "my_server"], timeout_s: 30}]`` — :class:`MCPTools` starts the
server (the ``mcp`` Python SDK's stdio client, on its own event loop in a background thread, so
environments and agent programs call it like any synchronous tool), lists its tools — each becomes a
:class:`~hyperrl.envs.Tool` whose JSON schema is the server's ``inputSchema`` (what chat templates and
an OpenAI ``tools`` list take) — and runs calls with a timeout. A server that does not start is an
:class:`MCPError` naming the command, at build; a call the server fails (``isError``), a timeout, or
a server that crashed mid-run are tool errors — the observation the model sees — and a crashed server
is started again for the next call, never a crashed run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

from hyperrl.envs.tools import Tool
from hyperrl.errors import HyperRLError

__all__ = ["MCPTools", "MCPError", "Toolbox", "KEEP_MARK"]

KEEP_MARK = "HYPERRL_KEEP"  # in a process's environment: the run's own (an MCP server), not an agent's leftover


class MCPError(HyperRLError, RuntimeError):
    """An MCP server that cannot serve the run (did not start, listed no tools)."""


class MCPTools:
    """The tools of the MCP server ``command`` (an argv list; no shell). ``timeout_s`` per call;
    ``start_timeout_s`` for the server to start and list its tools."""

    def __init__(self, command: list[str], *, timeout_s: float = 30.0, start_timeout_s: float = 30.0,
                 env: dict | None = None):
        if not command or not all(isinstance(a, str) for a in command):
            raise MCPError(f"tools[].mcp={command!r}: a non-empty argv list (no shell)")
        self.command, self.timeout_s, self.start_timeout_s, self.env = list(command), timeout_s, start_timeout_s, env
        self.restarts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hyperrl-mcp", daemon=True)
        self._thread.start()
        self._client = None
        self._lock = threading.Lock()
        try:
            specs = self._start()
        except BaseException:
            self.close()
            raise
        self.tools: dict[str, Tool] = {
            t.name: Tool(t.name, _Call(self, t.name), {**(t.input_schema or {"type": "object"})},
                         timeout=timeout_s, description=t.description or "") for t in specs}

    # ------------------------------------------------------------------ session
    def _start(self):
        """Start the server and list its tools (blocking)."""
        fut = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
        try:
            return fut.result(self.start_timeout_s)
        except Exception as e:  # noqa: BLE001 - named with the command
            fut.cancel()
            self._end_holder()  # a server that never answered is killed (it would hold the trainer's files)
            why = (f"no answer to initialize within {self.start_timeout_s:g} s; killed"
                   if isinstance(e, TimeoutError | concurrent.futures.TimeoutError) else f"{type(e).__name__}: {e}")
            tail = self._stderr_tail()
            raise MCPError(f"tools[].mcp={self.command}: the MCP server did not start ({why})"
                           + (f"; its stderr: {tail}" if tail else "")
                           + "; check the command runs by itself and speaks MCP over stdio") from None

    def _stderr_tail(self, n: int = 800) -> str:
        """The last ``n`` characters the server wrote to its stderr (a temporary file of its own)."""
        log = getattr(self, "_errlog", None)
        if log is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            log.flush()
            log.seek(0)
            text = log.read().strip()
            return text if len(text) <= n else "…" + text[-n:]
        return ""

    def _end_holder(self, grace_s: float = 5.0) -> None:
        """Stop the task holding the session: asked (the stop event), then cancelled after ``grace_s`` — leaving
        the session ends the server's process tree (the mcp SDK: close its stdin, SIGTERM, then SIGKILL)."""
        holder = getattr(self, "_holder", None)
        if holder is None or not self._loop.is_running():
            return
        if getattr(self, "_stop", None) is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

        async def end():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(holder), grace_s)
            if not holder.done():
                holder.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(holder, 10)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(end(), self._loop).result(grace_s + 12)

    async def _open(self):
        import tempfile

        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        started: asyncio.Future = asyncio.get_running_loop().create_future()
        if getattr(self, "_errlog", None) is None:  # the server's stderr: its tail names a failed start
            self._errlog = tempfile.TemporaryFile("w+", prefix="hyperrl-mcp-stderr-")
        self._stop = asyncio.Event()
        # marked as the run's own: an agent process ending what its agents started leaves the servers alone
        params = StdioServerParameters(command=self.command[0], args=self.command[1:],
                                       env={**(self.env or {}), KEEP_MARK: "mcp-server"})

        async def hold():  # the session's context is entered and left in this one task (anyio's rule)
            client = None
            try:
                async with Client(stdio_client(params, errlog=self._errlog), mode="legacy") as client:
                    listed = await client.list_tools()
                    self._client = client
                    if not started.done():
                        started.set_result(listed.tools)
                    await self._stop.wait()
            except BaseException as e:  # noqa: BLE001 - a start failure goes to the starter; a crash marks it dead
                if not started.done():
                    started.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            finally:
                if client is not None and self._client is client:
                    self._client = None

        self._holder = asyncio.get_running_loop().create_task(hold())
        tools = await started
        if not tools:
            raise MCPError("the server lists no tools")
        return tools

    def call(self, name: str, arguments: dict) -> str:
        """Call tool ``name``: its text content, or an exception whose message is the observation."""
        with self._lock:
            if self._client is None:  # crashed since the last call: start it again
                self.restarts += 1
                self._start()
            client = self._client
        fut = asyncio.run_coroutine_threadsafe(client.call_tool(name, arguments), self._loop)
        try:
            result = fut.result(self.timeout_s)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{name} timed out after {self.timeout_s}s") from None
        except Exception as e:  # noqa: BLE001 - the server went away mid-call: drop the session, start anew next call
            with self._lock:
                if self._client is client:
                    self._client = None
                    self._loop.call_soon_threadsafe(self._stop.set)
            raise RuntimeError(f"the MCP server failed during the call ({type(e).__name__}: {e}); it is started "
                               "again for the next call") from None
        text = "\n".join(getattr(c, "text", str(c)) for c in (result.content or []))
        if result.is_error:
            raise RuntimeError(text or "the tool reported an error")
        return text

    def close(self) -> None:
        """Stop the server and the loop (idempotent)."""
        if not self._thread.is_alive():
            return
        self._end_holder()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if getattr(self, "_errlog", None) is not None:
            self._errlog.close()
            self._errlog = None

    def specs(self) -> list[dict]:
        """The tools as an OpenAI ``tools`` list (and a chat template's ``tools=``)."""
        return [t.spec() for t in self.tools.values()]


class _Call:
    """A tool's ``fn``: ``fn(**arguments)`` → the server's text (picklable by name, not by closure)."""

    def __init__(self, box: MCPTools, name: str):
        self.box, self.name = box, name

    def __call__(self, **arguments) -> str:
        return self.box.call(self.name, arguments)


class Toolbox:
    """The run's ``tools:`` — MCP servers' tools and registered tools by name — for environments
    (:attr:`tools`, a ``name → Tool`` dict a :class:`~hyperrl.envs.ToolRunner` takes) and agent
    programs (``solve(sample, client, tools)``: :meth:`specs` for the request's ``tools``, :meth:`call`
    to run the model's call — an error or a timeout comes back as the text the model should see)."""

    def __init__(self, sources: list[dict]):
        from hyperrl.envs.tools import TOOLS

        self.servers: list[MCPTools] = []
        self.tools: dict[str, Tool] = {}
        try:
            for i, src in enumerate(sources):
                if src.get("mcp"):
                    server = MCPTools(list(src["mcp"]), timeout_s=float(src.get("timeout_s", 30.0)))
                    self.servers.append(server)
                    found = server.tools
                else:
                    tool = TOOLS.build(src["name"], **(src.get("args") or {}))()
                    found = {tool.name: tool}
                for name, tool in found.items():
                    if name in self.tools:
                        raise MCPError(f"tools[{i}]: a tool named {name!r} is already provided by an earlier entry")
                    self.tools[name] = tool
        except BaseException:
            self.close()
            raise

    def specs(self) -> list[dict]:
        return [t.spec() for t in self.tools.values()]

    def call(self, name: str, arguments: dict | str) -> str:
        """Run ``name`` (``arguments`` an object or its JSON text) with its timeout: its result, or
        ``"error: …"`` (unknown tool, invalid arguments, a failure, a timeout)."""
        import json

        from hyperrl.envs.tools import ToolRunner

        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as e:
            return f"error: malformed arguments JSON ({e.msg} at char {e.pos})"
        payload = json.dumps({"name": name, "arguments": args})
        (res,) = ToolRunner(self.tools, max_calls_per_turn=1, fmt="hyperrl").run(f"<tool>{payload}</tool>")
        return res.text

    def close(self) -> None:
        for s in self.servers:
            s.close()
        self.servers = []
