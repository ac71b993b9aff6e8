"""Tools: a registry with JSON-schema-validated arguments, timeouts and caps, and tool-call formats.

A model calls a tool in its family's format (:data:`TOOL_FORMATS`): ``hermes`` — Qwen / Hermes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, results returned as ``tool``-role
messages through the model's chat template (which lists the tools from their JSON schemas, built
from typed Python functions by ``transformers.utils.get_json_schema``: :meth:`Tool.from_function`);
``hyperrl`` — the compact ``<tool>{...}</tool>`` tags for the tiny default, results appended as
``<result>…</result>`` text; ``qwen3_coder``, ``glm45``, ``deepseek_v31``, ``kimi_k2`` — 2026's open models'
formats (:mod:`hyperrl.envs.call_formats`). Each format renders calls too (``render``). Every failure —
malformed JSON, unknown tool, schema violation, a raised exception, a timeout, too many calls in a
turn — becomes a ``ToolResult`` with ``ok=False`` whose text the model sees as an observation
(plus an optional invalid-action reward); it never crashes the rollout. Calls in one turn run
concurrently up to ``max_concurrency`` (threads: a tool stuck past its timeout is abandoned, not
killed — keep tools cooperative, or declare them ``isolate=True``: each call then runs in a forked
process that is killed at the timeout). The built-in calculator bounds its work exactly instead.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import jsonschema
from pydantic import AfterValidator

from hyperrl.registry import Registry

__all__ = ["Tool", "TOOLS", "register_tool", "ToolResult", "ToolRunner", "parse_tool_calls", "calculate", "python_tool",
           "BM25Index", "make_search_tool", "calculator_tool", "ToolFormat", "TOOL_FORMATS", "ToolFormatName",
           "resolve_call", "check_tool_format"]


@dataclass(frozen=True)
class Tool:
    """A callable tool: its ``name``, ``fn(**arguments) -> str``, the JSON ``schema`` its arguments are
    validated against, a per-call ``timeout`` (seconds), a ``description`` for the chat template."""

    name: str
    fn: Callable[..., str]
    schema: dict  # JSON schema of the arguments object
    timeout: float = 5.0
    description: str = ""
    isolate: bool = False  # run each call in a forked process, killed at the timeout (see ToolRunner)

    @staticmethod
    def from_function(fn: Callable[..., str], *, timeout: float = 5.0, isolate: bool = False) -> Tool:
        """A tool from a typed Python function with a Google-style docstring (``Args:``): name,
        description and argument schema by ``transformers.utils.get_json_schema``; unknown
        arguments are refused."""
        from transformers.utils import get_json_schema

        spec = get_json_schema(fn)["function"]
        schema = {**spec["parameters"], "additionalProperties": False}
        return Tool(spec["name"], fn, schema, timeout=timeout, description=spec.get("description", ""),
                    isolate=isolate)

    def spec(self) -> dict:
        """The OpenAI-style function schema chat templates take as ``tools=``."""
        params = {k: v for k, v in self.schema.items() if k != "additionalProperties"}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}


TOOLS: Registry = Registry("tool")


def register_tool(tool: Tool) -> Tool:
    """Register a ready :class:`Tool` under its name (its factory takes no hyperparameters)."""
    TOOLS.add(tool.name, lambda: tool)
    return tool


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome: the tool's ``name`` (``"?"`` when no tool was resolved), ``ok`` (False on any
    failure) and the ``text`` the model sees — the tool's return value or the error message."""

    name: str
    ok: bool
    text: str


_CALL = re.compile(r"<tool>(.*?)</tool>", re.S)


def parse_tool_calls(text: str) -> list[str]:
    """The raw JSON payloads of every ``<tool>…</tool>`` in ``text``."""
    return _CALL.findall(text)


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls and reads results. ``parse(text)`` → the raw JSON
    payloads; ``observation(results)`` → text appended as is (``chat=False``) or ``tool``-role
    messages rendered by the chat template (``chat=True``)."""

    name: str
    parse: Callable[[str], list[str]]
    chat: bool
    strip: Callable[[str], str] = str.strip  # the text around the calls (an OpenAI reply's ``content``)
    implicit_tool: bool = False  # a call without a name calls the only tool offered
    render: Callable[[str, dict], str] | None = None  # (name, arguments) → the call as the model writes it

    def observation(self, results: list[ToolResult]) -> str | list[dict]:
        if self.chat:
            return [{"role": "tool", "name": r.name, "content": r.text} for r in results]
        return "".join(f"<result>{r.text}</result>" for r in results)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

TOOL_FORMATS: Registry = Registry("tool-call format")
TOOL_FORMATS.add("hyperrl", lambda: ToolFormat(
    "hyperrl", parse_tool_calls, chat=False, strip=lambda t: _CALL.sub("", t).strip(),
    render=lambda n, a: "<tool>" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "</tool>"))
TOOL_FORMATS.add("hermes", lambda: ToolFormat(
    "hermes", _HERMES.findall, chat=True, strip=lambda t: _HERMES.sub("", t).strip(),
    render=lambda n, a: "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
    + "\n</tool_call>"))
# the tiny character model's call: a response beginning with "?" calls the only tool offered, without
# arguments (a task-bound tool, e.g. an agent's calculator over its own question)
TOOL_FORMATS.add("qmark", lambda: ToolFormat("qmark", lambda t: ["{}"] if t.startswith("?") else [], chat=True,
                                              strip=lambda t: t[1:].strip() if t.startswith("?") else t.strip(),
                                              implicit_tool=True))


def _register_2026_formats() -> None:
    """Qwen3-Coder, GLM-4.5, DeepSeek-V3.1 and Kimi-K2 (:mod:`hyperrl.envs.call_formats`)."""
    from hyperrl.envs.call_formats import FORMATS

    for name, (parse, pattern, render) in FORMATS.items():
        TOOL_FORMATS.add(name, lambda name=name, parse=parse, pattern=pattern, render=render: ToolFormat(
            name, parse, chat=True, strip=lambda t, p=pattern: p.sub("", t).strip(), render=render))


_register_2026_formats()


def resolve_call(payload: str, fmt: ToolFormat, names: list[str]) -> tuple[str, object] | str:
    """A raw call payload → ``(name, arguments)``, or the error text the model should see instead:
    malformed JSON, no name (unless the format calls the only tool ``names`` offers), an unknown tool."""
    try:
        call = json.loads(payload)
    except json.JSONDecodeError as e:
        return f"error: malformed tool call JSON ({e.msg} at char {e.pos})"
    if isinstance(call, dict) and "name" not in call and fmt.implicit_tool and len(names) == 1:
        call = {**call, "name": names[0]}
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'error: a tool call needs {"name": str, "arguments": {...}}'
    if call["name"] not in names:
        return f"error: unknown tool {call['name']!r}; available: {sorted(names)}"
    return call["name"], call.get("arguments", {})


def check_tool_format(name: str) -> str:
    """``name`` if it is a registered tool-call format (:data:`TOOL_FORMATS`), else a ``ValueError`` listing them."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; registered: {TOOL_FORMATS.names()}")
    return name


ToolFormatName = Annotated[str, AfterValidator(check_tool_format)]


_WARNED: set[str] = set()


def _isolated(tool: Tool, args: dict) -> str:
    """One call in a forked child process, killed (SIGKILL) when it has not answered within
    ``tool.timeout`` — what a thread cannot do to code that never yields (a C loop holding the GIL,
    a runaway computation). The child inherits memory (an in-memory index, the tool's state) and
    runs only the calling thread: keep isolated tools free of torch and other thread pools."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def target():
        try:
            send.send(("ok", str(tool.fn(**args))))
        except BaseException as e:  # noqa: BLE001 - reported to the parent as the tool's failure
            send.send(("error", f"{type(e).__name__}: {e}"))

    proc = ctx.Process(target=target, daemon=True)
    proc.start()
    try:
        if not recv.poll(tool.timeout):
            raise FutureTimeout()
        kind, value = recv.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
        send.close()
    if kind == "error":
        raise RuntimeError(value)
    return value


class ToolRunner:
    """Runs the tool calls a response makes: parses them in its format (``fmt``: a ``TOOL_FORMATS`` name), at most
    ``max_calls_per_turn`` per turn and ``max_concurrency`` at once, each call's error or timeout an
    observation, never a crash."""

    def __init__(self, tools: dict[str, Tool] | None = None, *, max_calls_per_turn: int = 4, max_concurrency: int = 4,
                 fmt: str = "hyperrl"):
        self.tools = tools if tools is not None else {n: TOOLS.build(n)() for n in TOOLS.names()}
        self.max_calls, self.max_concurrency = max_calls_per_turn, max_concurrency
        self.format: ToolFormat = TOOL_FORMATS.build(fmt)()

    def _prepare(self, payload: str):
        call = resolve_call(payload, self.format, list(self.tools))
        if isinstance(call, str):
            return None, ToolResult("?", False, call)
        tool, args = self.tools[call[0]], call[1]
        try:
            jsonschema.validate(args, tool.schema)
        except jsonschema.ValidationError as e:
            return None, ToolResult(tool.name, False, f"error: invalid arguments for {tool.name}: {e.message}")
        return (tool, args), None

    def specs(self) -> list[dict]:
        """The tools' schemas for the chat template (``tools=``)."""
        return [t.spec() for t in self.tools.values()]

    def run(self, text: str) -> list[ToolResult]:
        payloads = self.format.parse(text)
        results: list[ToolResult | None] = [None] * len(payloads)
        jobs = []
        for i, payload in enumerate(payloads):
            if i >= self.max_calls:
                results[i] = ToolResult("?", False, f"error: more than {self.max_calls} tool calls in one turn")
                continue
            prepared, err = self._prepare(payload)
            if err:
                results[i] = err
            else:
                jobs.append((i, *prepared))
        if jobs:
            pool = ThreadPoolExecutor(max_workers=self.max_concurrency)
            futures = [(i, tool, pool.submit(_isolated, tool, args) if tool.isolate else pool.submit(tool.fn, **args))
                       for i, tool, args in jobs]
            for i, tool, fut in futures:
                try:  # an isolated call enforces its own deadline (and kills); the margin covers the fork
                    results[i] = ToolResult(tool.name, True, str(fut.result(timeout=tool.timeout +
                                                                           (5.0 if tool.isolate else 0.0))))
                except FutureTimeout:
                    results[i] = ToolResult(tool.name, False, f"error: {tool.name} timed out after {tool.timeout}s")
                    if not tool.isolate and tool.name not in _WARNED:  # its thread runs on: say so, once
                        _WARNED.add(tool.name)
                        import sys

                        print(f"warning: tool {tool.name!r} timed out; its thread cannot be stopped and keeps running "
                              "— declare it with isolate=True (a process, killed at the timeout)", file=sys.stderr)
                except Exception as e:  # noqa: BLE001 - a tool error is an observation, not a crash
                    results[i] = ToolResult(tool.name, False, f"error: {tool.name} failed: {type(e).__name__}: {e}")
            pool.shutdown(wait=False, cancel_futures=True)
        return results


# ----------------------------------------------------------------------------- calculator

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bits(x) -> int:
    """An integer's size in bits (a float's magnitude in bits: floats overflow, they never grow)."""
    return abs(x).bit_length() if isinstance(x, int) else 0


def calculate(expression: str, *, max_len: int = 200, max_exponent: int = 64, max_bits: int = 1024) -> str:
    """Evaluate arithmetic safely (an ``ast`` whitelist: numbers, + − × ÷ // % **, parentheses;
    no names, calls or attributes — never ``eval``). Returns the result as text.

    Bounded exactly, before any work: no operand or result exceeds ``max_bits`` bits (≈ 308 decimal
    digits at 1,024) — a power's and a product's size are known from their operands' bit lengths
    before they are computed, so ``(((9**64)**64)**64)**64`` is refused at once instead of holding
    the GIL for seconds (a thread cannot be interrupted); float overflow is an error."""
    if len(expression) > max_len:
        raise ValueError(f"expression longer than {max_len} characters")
    tree = ast.parse(expression, mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            if _bits(node.value) > max_bits:
                raise ValueError(f"a number of more than {max_bits} bits")
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(b) > max_exponent:
                    raise ValueError(f"exponent {b} exceeds {max_exponent}")
                if isinstance(b, int) and b > 0 and _bits(a) * b > max_bits + b:  # |a|^b < 2^(bits·b)
                    raise ValueError(f"the result would exceed {max_bits} bits")
            if isinstance(node.op, ast.Mult) and _bits(a) + _bits(b) > max_bits + 1:
                raise ValueError(f"the result would exceed {max_bits} bits")
            try:
                out = _BIN[type(node.op)](a, b)
            except OverflowError:
                raise ValueError("the result overflows") from None
            if _bits(out) > max_bits:
                raise ValueError(f"the result exceeds {max_bits} bits")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax: {type(node).__name__}")

    value = ev(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        if value.is_integer():
            value = int(value)
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12"
    """
    return calculate(expression)


calculator_tool = register_tool(Tool(
    "calculator", calculator,
    {"type": "object", "properties": {"expression": {"type": "string", "minLength": 1,
                                                     "description": "numbers with + - * / // % ** and parentheses"}},
     "required": ["expression"], "additionalProperties": False},
    timeout=2.0, description="Evaluate an arithmetic expression."))


# ----------------------------------------------------------------------------- python, sandboxed


@TOOLS.register("python")
def python_tool(*, wall_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512, processes: int = 32,
                output_chars: int = 4000, slots: int = 4) -> Tool:
    """A ``python`` tool: the model's code run by the system Python in the sandbox (:mod:`hyperrl.sandbox`: no
    network, no file of the run's, its own uid and limits); the answer is its stdout, then its stderr, cut to
    ``output_chars`` (the cut said), and — unless it exited 0 — the verdict (``[error]``, ``[timeout]``,
    ``[memory]``, ``[output_limit]``, ``[killed]``). ``slots`` calls run at once, each slot a sandbox of its own uid
    (:func:`hyperrl.sandbox.allocate_uids`). A machine without the sandbox fails here, at build."""
    import queue

    from hyperrl.sandbox import Limits, Sandbox, allocate_uids

    limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb, processes=processes)
    free: queue.Queue = queue.Queue()
    for uid in allocate_uids(slots):
        free.put(Sandbox(limits, uid=uid))

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: a Python program; print what you want to see
        """
        box = free.get()
        try:
            r = box.run_python(code)
        finally:
            free.put(box)
        text = (r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr
                            else "")).rstrip("\n")
        if len(text) > output_chars:
            text = text[:output_chars] + f"\n[… {len(text) - output_chars} more characters cut]"
        if not r.ok:
            text += ("\n" if text else "") + f"[{r.verdict}]"
        return text or "(no output)"

    return Tool("python", python, {"type": "object", "properties": {"code": {
        "type": "string", "minLength": 1, "description": "a Python program; print what you want to see"}},
        "required": ["code"], "additionalProperties": False}, timeout=wall_s + 5.0,
        description="Run Python code in a sandbox (no network, no files kept) and return what it prints.")


# ----------------------------------------------------------------------------- BM25 search

_WORD = re.compile(r"\w+")


class BM25Index:
    """Okapi BM25 over a small local corpus (our own ~30 lines: no extra dependency, exact and
    deterministic; rank_bm25/bm25s would add a package for the same formula).
    ``score(q, d) = Σ_t idf(t)·f(t,d)(k1+1) / (f(t,d) + k1(1 − b + b·|d|/avgdl))``,
    ``idf = ln(1 + (N − n_t + 0.5)/(n_t + 0.5))``."""

    def __init__(self, docs: list[dict], *, k1: float = 1.5, b: float = 0.75, text_key: str = "text"):
        if not docs:
            raise ValueError("corpus: no documents")
        self.docs, self.k1, self.b = docs, k1, b
        self.tf = [Counter(_WORD.findall(str(d[text_key]).lower())) for d in docs]
        self.len = [sum(c.values()) for c in self.tf]
        self.avgdl = sum(self.len) / len(self.len)
        df = Counter(t for c in self.tf for t in c)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - k + 0.5) / (k + 0.5)) for t, k in df.items()}
        self.text_key = text_key

    @staticmethod
    def from_jsonl(path: str | Path, **kw) -> BM25Index:
        docs = []
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
        return BM25Index(docs, **kw)

    def search(self, query: str, k: int = 3) -> list[tuple[float, dict]]:
        q = _WORD.findall(query.lower())
        scores = []
        for i, (tf, dl) in enumerate(zip(self.tf, self.len)):
            s = 0.0
            for t in q:
                f = tf.get(t, 0)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * dl / self.avgdl))
            scores.append((s, -i))
        top = sorted(scores, reverse=True)[:k]
        return [(s, self.docs[-i]) for s, i in top if s > 0]


def make_search_tool(index: BM25Index, *, k: int = 3, name: str = "search") -> Tool:
    """A ``search(query)`` tool over a :class:`BM25Index`: the ``k`` best documents, numbered, as its observation
    (``no results`` when none match)."""
    def search(query: str) -> str:
        hits = index.search(query, k)
        return "\n".join(f"[{j + 1}] {d[index.text_key]}" for j, (_, d) in enumerate(hits)) or "no results"

    return Tool(name, search, {"type": "object", "properties": {"query": {"type": "string", "minLength": 1}},
                               "required": ["query"], "additionalProperties": False}, timeout=5.0,
                description="BM25 search over the local corpus")
