"""OpenAI's Responses API (``POST /v1/responses``) in front of the gateway's chat core: pure translations.

A request becomes the chat messages and function tools the chat template renders (so the row rule — a call
that extends a chain reuses its sampled ids — holds across protocols); the sampled turn becomes the response's
output items (a ``message`` with ``output_text``, then one ``function_call`` per tool call) and, streamed, the
server-sent events the official ``openai`` SDK's Responses stream parser and Codex read, in their order:
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` → (a message:
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``; a call: ``response.function_call_arguments.delta``, ``….done``) →
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete`` when the token budget cut
the turn) with ``usage``. The stream is written from the finished turn: what is sampled never depends on whether
the client streams.

Served: ``input`` (a string, or items: ``message`` — roles user / system / developer / assistant, text parts —
``function_call``, ``function_call_output``, and ``reasoning`` items passed back, which carry nothing a text
policy needs and are dropped), ``instructions`` (a system message first; not carried over by
``previous_response_id``, as OpenAI's), function ``tools``, ``tool_choice``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``store`` and ``previous_response_id`` (a stored response of the same
episode). Fields a client sends that change nothing here (``reasoning``, ``include``, ``metadata``,
``prompt_cache_key``, ``parallel_tool_calls``, …) are accepted; any other field is a 400 naming it.
"""

from __future__ import annotations

import json

from hyperrl.agents.limits import schema_problem
from hyperrl.errors import HyperRLError

__all__ = ["IGNORED_FIELDS", "SERVED_FIELDS", "RequestError", "request_messages", "request_tools",
           "request_tool_choice", "text_parts", "check_fields", "output_items", "response_object", "stream_events",
           "history_of"]

SERVED_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
                           "temperature", "top_p", "stream", "store", "previous_response_id"})
# accepted and without effect: reasoning effort / summaries (the policy has no separate reasoning channel),
# what to include, bookkeeping, caching and service hints, parallel calls (the model decides), text format text
IGNORED_FIELDS = frozenset({"reasoning", "include", "metadata", "user", "prompt_cache_key", "parallel_tool_calls",
                            "service_tier", "safety_identifier", "stream_options", "truncation", "text",
                            "client_metadata", "prompt_cache_retention", "background"})


class RequestError(HyperRLError, ValueError):
    """A request field the gateway cannot serve: ``param`` (the field, dotted) and the message."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _check_fields(body: dict) -> None:
    check_fields(body, SERVED_FIELDS, IGNORED_FIELDS, "Responses API")
    text = body.get("text")
    if text is not None and (not isinstance(text, dict) or (text.get("format") or {"type": "text"}).get("type")
                             != "text"):
        raise RequestError("text.format", "only {'type': 'text'} is served (no structured outputs)")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("truncation", f"{body['truncation']!r}: only 'disabled' is served (the gateway never "
                                         "drops context: a row's tokens are what the model saw)")
    if body.get("background"):
        raise RequestError("background", "background responses are not served; omit it")


def text_parts(content, where: str, kinds=("input_text", "output_text", "text")) -> str:
    """A message's content: a string, or a list of text parts (whose ``type`` is one of ``kinds``) joined; anything
    else a :class:`RequestError` naming where (``where[j].type``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, "must be a string or a list of text parts")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds or not isinstance(p.get("text"), str):
            raise RequestError(f"{where}[{j}].type", f"{kind!r}: only text parts are served (a text policy)")
        out.append(p["text"])
    return "".join(out)


def check_fields(body: dict, served: frozenset, ignored: frozenset, api: str) -> None:
    """Every field of ``body`` is ``served`` or ``ignored`` (accepted without effect); else a 400 naming it."""
    for k in body:
        if k not in served and k not in ignored:
            raise RequestError(k, f"unknown or unsupported parameter for this gateway's {api}")


def request_messages(body: dict, history: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """``(messages, turn)``: the chat messages of the call — ``instructions`` as a system message, then
    ``history`` (a stored previous response's), then this request's ``input`` — and ``turn``, the messages of
    ``input`` alone (what a stored response adds to its history)."""
    _check_fields(body)
    raw = body.get("input")
    if isinstance(raw, str):
        items = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise RequestError("input", "must be a string or a non-empty list of input items")
    turn: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}]", "must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"input[{i}].role", f"{role!r}: one of user, system, developer, assistant")
            text = text_parts(item.get("content"), f"input[{i}].content")
            if role == "assistant" and turn and turn[-1]["role"] == "assistant" and not turn[-1].get("tool_calls"):
                turn[-1]["content"] += text
            else:
                turn.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(args, str):
                raise RequestError(f"input[{i}]", "a function_call needs 'name' and 'arguments' (a JSON string)")
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": args}}
            if turn and turn[-1]["role"] == "assistant":
                turn[-1].setdefault("tool_calls", []).append(call)
            else:
                turn.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            text = out if isinstance(out, str) else text_parts(out, f"input[{i}].output")
            turn.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text})
        elif kind == "reasoning":
            continue  # passed back by clients that keep reasoning state; a text policy's is in its text
        else:
            raise RequestError(f"input[{i}].type", f"{kind!r}: not served (message, function_call, "
                                                   "function_call_output and reasoning items are)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions", "must be a string")
    head = [{"role": "system", "content": instructions}] if instructions else []
    return head + list(history or []) + turn, turn


def request_tools(body: dict) -> list[dict] | None:
    """The function ``tools`` in the chat form the template takes (``{"type": "function", "function": {…}}``);
    any other tool type is a :class:`RequestError` naming it."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}].type", f"{kind!r}: only function tools are served (built-in tools — "
                                                   "web search, file search, shell, custom — are not)")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise RequestError(f"tools[{i}].name", "a function tool needs a name")
        if t.get("parameters") is not None and (why := schema_problem(t["parameters"])):
            raise RequestError(f"tools[{i}].parameters", why)
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    return out


def request_tool_choice(body: dict, names: list[str]) -> str:
    """``tool_choice``: ``auto`` / ``none`` / ``required`` / ``{"type": "function", "name": …}`` (a function
    offered; recorded as asked — sampling is never constrained)."""
    v = body.get("tool_choice", "auto")
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and v.get("name") in names:
        return "auto"
    raise RequestError("tool_choice", f"{v!r}: 'auto', 'none', 'required' or {{'type': 'function', 'name': …}} "
                                      "naming an offered tool")


def output_items(rid: str, content: str, calls: list[tuple[str, object]]) -> list[dict]:
    """A sampled turn as output items: a ``message`` (when there is text, or nothing else) then one
    ``function_call`` per call (``call_id`` unique within the episode)."""
    items = []
    if content or not calls:
        items.append({"id": f"msg_{rid}", "type": "message", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    for k, (name, args) in enumerate(calls):
        items.append({"id": f"fc_{rid}_{k}", "type": "function_call", "status": "completed",
                      "call_id": f"call_{rid}_{k}", "name": name,
                      "arguments": args if isinstance(args, str) else json.dumps(args)})
    return items


def history_of(turn: list[dict], items: list[dict], history: list[dict] | None) -> list[dict]:
    """What a stored response carries for ``previous_response_id``: the earlier history, this request's
    input messages and the response's output as chat messages (instructions excluded, as OpenAI's)."""
    reply = {"role": "assistant", "content": "", "tool_calls": []}
    for it in items:
        if it["type"] == "message":
            reply["content"] += "".join(p["text"] for p in it["content"])
        else:
            reply["tool_calls"].append({"id": it["call_id"], "type": "function",
                                        "function": {"name": it["name"], "arguments": it["arguments"]}})
    if not reply["tool_calls"]:
        del reply["tool_calls"]
    return list(history or []) + list(turn) + [reply]


def response_object(rid: str, model: str, created: int, body: dict, items: list[dict], *, incomplete: bool,
                    input_tokens: int, output_tokens: int, status: str | None = None) -> dict:
    """The ``response`` object (``status`` completed, or incomplete with ``max_output_tokens`` as the
    reason when the budget cut a turn that made no call)."""
    status = status or ("incomplete" if incomplete else "completed")
    return {"id": f"resp_{rid}", "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": model, "output": items, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True), "temperature": body.get("temperature", 1.0),
            "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0), "truncation": "disabled",
            "metadata": body.get("metadata") or {}, "user": None,
            "usage": None if status == "in_progress" else {
                "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens}}


def _chunks(text: str, size: int = 32) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or []


def stream_events(response: dict) -> list[dict]:
    """The server-sent events of ``response`` (a finished response object), in OpenAI's order, each with its
    ``type`` and ``sequence_number``."""
    events: list[dict] = []

    def emit(kind: str, **fields) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    start = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=start)
    emit("response.in_progress", response=start)
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            emit("response.output_item.added", output_index=i,
                 item={**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            emit("response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part)
            for piece in _chunks(text):
                emit("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                     delta=piece, logprobs=[])
            emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text,
                 logprobs=[])
            emit("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                 part={**part, "text": text})
        else:
            emit("response.output_item.added", output_index=i,
                 item={**item, "status": "in_progress", "arguments": ""})
            for piece in _chunks(item["arguments"]):
                emit("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=piece)
            emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                 arguments=item["arguments"], name=item["name"])
        emit("response.output_item.done", output_index=i, item=item)
    emit("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
    return events
