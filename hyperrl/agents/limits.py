"""What one request may cost the gateway: a body bounded by the context before it is parsed, JSON refused by
name (not UTF-8, nested past the parser), and a cache of rendered prompts that keeps only what was served, bounded
by bytes.

A request's prompt must fit the context (``max_model_len`` tokens) to be served, and no token decodes to more
bytes than the longest token of the vocabulary; JSON escapes a byte in at most 6 (``\\u00XX``). So a body larger
than ``6 · longest · context`` plus an envelope for what is not rendered (ids, sampling fields, metadata: 1 MiB)
cannot be served — it is refused (413) as it arrives, before a byte of it is parsed, rendered or tokenised, and
without holding the event loop the other episodes' calls go through.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict

from hyperrl.agents.record import render_messages
from hyperrl.errors import HyperRLError

__all__ = ["body_bound", "parse_body", "RenderCache", "RENDER_CACHE_BYTES", "ENVELOPE_BYTES", "BodyError",
           "schema_problem"]

ENVELOPE_BYTES = 1 << 20
RENDER_CACHE_BYTES = 64 << 20


class BodyError(HyperRLError, ValueError):
    """A request body that is not a JSON object (the reason in the message)."""


def body_bound(tokenizer, context: int) -> int:
    """The largest body a request whose prompt fits ``context`` tokens can have (see the module doc): ``6 ·
    longest token's bytes · context + 1 MiB``."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8")) for t in vocab), default=16)
    return 6 * max(longest, 2) * int(context) + ENVELOPE_BYTES


def parse_body(raw: bytes) -> dict:
    """A request body → its JSON object, or :class:`BodyError` naming why not: not UTF-8 (the offset), not JSON
    (the position), nested deeper than the parser goes, not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"not UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BodyError(f"not JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise BodyError("JSON nested deeper than the parser allows (about 1,000 levels)") from None
    if not isinstance(body, dict):
        raise BodyError("must be a JSON object")
    return body


def schema_problem(schema) -> str | None:
    """Why a tool's parameters are not a JSON Schema object (None: they are) — checked against the JSON Schema
    meta-schema (draft 2020-12, ``jsonschema``); a tool list repeated every call is checked once."""
    if not isinstance(schema, dict):
        return f"must be a JSON Schema object, not {type(schema).__name__}"
    try:
        return _schema_problem(json.dumps(schema, sort_keys=True))
    except (TypeError, ValueError, RecursionError):
        return "not serialisable as JSON"


@functools.lru_cache(maxsize=1024)
def _schema_problem(text: str) -> str | None:
    from jsonschema import Draft202012Validator, SchemaError

    schema = json.loads(text)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"not a valid JSON Schema ({e.message}{f' at {where}' if where else ''})"
    if schema.get("type", "object") != "object":
        return f"must describe an object (type {schema.get('type')!r})"
    return None


class RenderCache:
    """Rendered prompts (messages and tools → ids) of calls that were served, least recently used first out,
    at most ``max_bytes`` (keys' bytes plus 8 a token). :meth:`render` looks up or renders (never stores);
    :meth:`keep` stores a served one. Thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.size = int(max_bytes), 0
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._last = threading.local()  # this thread's last (msgs, tools, key): keep() reuses render()'s key

    def _key(self, msgs: list, tools: list | None) -> str:
        last = getattr(self._last, "value", None)
        if last is not None and last[0] is msgs and last[1] is tools:
            return last[2]
        key = json.dumps([msgs, tools])  # key order kept: templates render it
        self._last.value = (msgs, tools, key)
        return key

    def render(self, tokenizer, msgs: list, tools: list | None) -> tuple[int, ...]:
        """The ids of ``msgs`` and ``tools`` as the chat template renders them (cached when served before)."""
        key = self._key(msgs, tools)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit
        return tuple(render_messages(tokenizer, msgs, tools))

    def keep(self, msgs: list, tools: list | None, ids) -> None:
        """Store a served prompt, evicting the least recently used past ``max_bytes`` (one larger than the bound
        is not stored)."""
        key = self._key(msgs, tools)
        cost = len(key) + 8 * len(ids)
        if cost > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return
            self._items[key] = tuple(ids)
            self.size += cost
            while self.size > self.max_bytes:
                old, old_ids = self._items.popitem(last=False)
                self.size -= len(old) + 8 * len(old_ids)
