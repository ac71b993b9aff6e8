"""Streamed answers of the gateway (:mod:`hyperrl.agents.gateway`): what a handler returns to be written as
server-sent events, and a chat completion as its ``chat.completion.chunk`` objects. (The Responses and Messages
APIs' event sequences are in their own modules.)"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SSE", "chat_chunks"]


@dataclass
class SSE:
    """A streamed answer: its events (``named``: each written with its ``event:`` line, as the Responses and
    Messages APIs do; ``done``: ended by ``data: [DONE]``, as chat completions are) and the record entry it
    answers (marked ``abandoned`` when the client leaves before the end)."""

    events: list[dict]
    named: bool = False
    done: bool = False
    episode: object | None = None  # the GatewayEpisode
    log_index: int | None = None


def chat_chunks(out: dict, include_usage: bool) -> list[dict]:
    """A chat completion as the ``chat.completion.chunk`` objects of its stream: per choice the role, the
    content in pieces (one piece with its log-probs when they were asked for), each tool call's id and name then
    its arguments, and the finish reason; with ``include_usage`` a last chunk with no choices and the usage."""
    head = {"id": out["id"], "object": "chat.completion.chunk", "created": out["created"], "model": out["model"]}
    extra = {"usage": None} if include_usage else {}
    chunks = []

    def emit(j: int, delta: dict, finish=None, logprobs=None) -> None:
        chunks.append({**head, "choices": [{"index": j, "delta": delta, "finish_reason": finish,
                                            "logprobs": logprobs}], **extra})

    for c in out["choices"]:
        j, msg = c["index"], c["message"]
        emit(j, {"role": "assistant", "content": ""})
        text = msg.get("content") or ""
        if c.get("logprobs") is not None:
            emit(j, {"content": text}, logprobs=c["logprobs"])
        else:
            for k in range(0, len(text), 32):
                emit(j, {"content": text[k:k + 32]})
        for k, call in enumerate(msg.get("tool_calls") or []):
            emit(j, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": ""}}]})
            args = call["function"]["arguments"]
            for a in range(0, len(args), 32):
                emit(j, {"tool_calls": [{"index": k, "function": {"arguments": args[a:a + 32]}}]})
        emit(j, {}, finish=c["finish_reason"])
    if include_usage:
        chunks.append({**head, "choices": [], "usage": out["usage"]})
    return chunks
