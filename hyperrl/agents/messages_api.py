"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) in front of the gateway's chat
core: pure translations, as :mod:`hyperrl.agents.responses_api` does for OpenAI's Responses.

A request becomes chat messages (``system`` first; an assistant turn's ``text`` and ``tool_use`` blocks one
assistant message with tool calls; a user turn's ``tool_result`` blocks tool messages, its text a user message)
and function tools (``input_schema`` as the parameters); the sampled turn becomes ``content`` blocks — ``text``,
then one ``tool_use`` per call — with ``stop_reason`` ``end_turn`` / ``tool_use`` / ``max_tokens`` /
``stop_sequence``; streamed, the events the official ``anthropic`` SDK and Claude Code read: ``message_start``,
per block ``content_block_start`` → ``content_block_delta`` (``text_delta`` / ``input_json_delta``)… →
``content_block_stop``, ``message_delta`` (``stop_reason``, usage), ``message_stop``, a ``ping`` after the start.
Written from the finished turn, as the Responses stream is.

Served: ``model``, ``messages``, ``system`` (a string or text blocks), ``max_tokens`` (required, as Anthropic's),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` (a training run samples at its own values, as for
every protocol), ``stream``, ``tools`` (custom tools; Anthropic's server tools — web search, bash, text editor…
— are refused by name), ``tool_choice``, ``thinking`` when disabled or adaptive (a budgeted one is refused),
``system`` turns among the messages (Claude Code's reminders). Accepted without effect: ``metadata``,
``service_tier``, ``context_management``, ``output_config`` (effort), ``cache_control`` on blocks. Anything else
is a 400 naming the field.
"""

from __future__ import annotations

from hyperrl.agents.limits import schema_problem
from hyperrl.agents.responses_api import RequestError, check_fields, text_parts

__all__ = ["SERVED_FIELDS", "IGNORED_FIELDS", "request_messages", "request_tools", "request_tool_choice",
           "content_blocks", "message_object", "stream_events", "stop_reason"]

SERVED_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
                           "top_k", "stream", "tools", "tool_choice", "thinking"})
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "context_management", "container", "output_config"})


def _text_blocks(content, where: str) -> str:
    return text_parts(content, where, kinds=("text",))


def _check_fields(body: dict) -> None:
    check_fields(body, SERVED_FIELDS, IGNORED_FIELDS, "Messages API")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") not in ("disabled",
                                                                                                "adaptive")):
        raise RequestError("thinking", "extended thinking with a budget is not served (the policy's reasoning is in "
                                       "its text); omit it or send {'type': 'disabled'} or {'type': 'adaptive'}")


def request_messages(body: dict) -> list[dict]:
    """The chat messages of a Messages request (see the module doc)."""
    _check_fields(body)
    if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool) or body["max_tokens"] < 1:
        raise RequestError("max_tokens", "required: a positive integer")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages", "must be a non-empty list of {role, content}")
    out = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise RequestError(f"messages[{i}].role", f"{role!r}: 'user', 'assistant' or 'system'")
        content = m.get("content")
        if role == "system":  # Claude Code sends reminders as system turns among the messages
            out.append({"role": "system", "content": _text_blocks(content, f"messages[{i}].content")})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"messages[{i}].content", "must be a string or a list of content blocks")
        text, calls, results = [], [], []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise RequestError(where, "a tool_use block needs 'name' and 'input' (an object)")
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and role == "user":
                c = b.get("content", "")
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                "content": _text_blocks(c, f"{where}.content") if c else ""})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # passed back by clients; a text policy's reasoning is in its text
            else:
                raise RequestError(f"{where}.type", f"{kind!r} in a {role} message: not served (text, tool_use in "
                                                    "assistant turns, tool_result in user turns are)")
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out += results
            if text or not results:
                out.append({"role": "user", "content": "".join(text)})
    return out


def request_tools(body: dict) -> list[dict] | None:
    """Custom ``tools`` (``{name, description, input_schema}``) in the chat form; a server tool (a ``type``
    such as ``web_search_20250305``) is refused by name."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of {name, description, input_schema}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{i}].type", f"{kind!r}: Anthropic's server tools are not served; define it "
                                                   "as a custom tool (name, description, input_schema)")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise RequestError(f"tools[{i}].name", "a tool needs a name")
        if "input_schema" in t and (why := schema_problem(t["input_schema"])):
            raise RequestError(f"tools[{i}].input_schema", why)
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                      "parameters": t.get("input_schema") or {"type": "object"}}})
    return out


def request_tool_choice(body: dict, names: list[str]) -> str:
    """``tool_choice``: ``{"type": "auto" | "any" | "none"}`` or ``{"type": "tool", "name": …}`` (recorded as asked;
    sampling is never constrained)."""
    v = body.get("tool_choice") or {"type": "auto"}
    kind = v.get("type") if isinstance(v, dict) else None
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    if kind == "tool" and v.get("name") in names:
        return "auto"
    raise RequestError("tool_choice", f"{v!r}: {{'type': 'auto' | 'any' | 'none'}} or {{'type': 'tool', 'name': …}} "
                                      "naming an offered tool")


def content_blocks(mid: str, content: str, calls: list[tuple[str, object]]) -> list[dict]:
    """A sampled turn as content blocks: its text (when any, or nothing else), then one ``tool_use`` per call."""
    blocks = [{"type": "text", "text": content}] if content or not calls else []
    for k, (name, args) in enumerate(calls):
        blocks.append({"type": "tool_use", "id": f"toolu_{mid}_{k}", "name": name,
                       "input": args if isinstance(args, dict) else {"input": args}})
    return blocks


def stop_reason(calls: bool, finish_reason: str, stop_sequence: str | None) -> str:
    """``tool_use`` (a call), ``stop_sequence`` (one of ``stop_sequences`` met), ``max_tokens`` (the budget cut
    the turn) or ``end_turn``."""
    if calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def message_object(mid: str, model: str, blocks: list[dict], reason: str | None, stop_sequence: str | None,
                   input_tokens: int, output_tokens: int) -> dict:
    """The ``message`` object of a sampled turn: its content blocks, stop reason (and the stop sequence met), usage."""
    return {"id": f"msg_{mid}", "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def stream_events(message: dict) -> list[dict]:
    """The server-sent events of a finished ``message`` in Anthropic's order (see the module doc)."""
    import json

    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**message["usage"], "output_tokens": 1}}
    events = [{"type": "message_start", "message": start}, {"type": "ping"}]
    for i, b in enumerate(message["content"]):
        if b["type"] == "text":
            events.append({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})
            text = b["text"]
            for k in range(0, len(text), 32):
                events.append({"type": "content_block_delta", "index": i,
                               "delta": {"type": "text_delta", "text": text[k:k + 32]}})
        else:
            events.append({"type": "content_block_start", "index": i,
                           "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}})
            js = json.dumps(b["input"])
            for k in range(0, len(js), 32):
                events.append({"type": "content_block_delta", "index": i,
                               "delta": {"type": "input_json_delta", "partial_json": js[k:k + 32]}})
        events.append({"type": "content_block_stop", "index": i})
    events.append({"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                      "stop_sequence": message["stop_sequence"]},
                   "usage": {"output_tokens": message["usage"]["output_tokens"]}})
    events.append({"type": "message_stop"})
    return events
