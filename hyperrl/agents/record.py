"""Token-in-token-out recording: an agent's calls as trajectory rows, the sampled ids never re-tokenised.

An agent talks text (OpenAI messages); the trainer needs the exact ids the engine sampled. An
:class:`EpisodeRecord` keeps the episode's **chains** — one trajectory row each — and turns every
call into prompt ids:

* a chat call whose ``messages`` *extend* a chain — the chain's messages, then the assistant reply
  the gateway returned for it (compared by role, content and tool calls, whatever ids or extra
  fields the client echoes), then any new messages — continues that chain: its ids are the chain's
  ids as sampled, then the chat template's own tokens between that turn and the next generation
  prompt (:func:`hyperrl.tokenizer.observation_ids`: the turn's closing the model did not sample,
  e.g. ChatML's ``\\n`` after ``<|im_end|>``, the tool results, the next generation prompt);
* a completions call whose prompt ids (given as ids) or text (given as a string) starts with a
  chain's ids or text continues it the same way (the remainder tokenised once);
* any other call (the agent rewrote or dropped its history, a new conversation) starts a new chain
  whose prompt is rendered and tokenised whole — context only (action mask 0): tokens sampled
  earlier are trained in the chain that sampled them, never twice and never re-tokenised.

**The row rule: one row per prefix-consistent chain.** Two calls extending a chain at once (an agent's
parallel branches): the first to finish continues it, the other starts a row whose prompt is context.
A call sampling ``n > 1`` choices forks: the
first choice continues the chain, each other choice becomes a chain of its own whose copy of the
shared prefix is context (its sampled tokens are trained once, in the first). Every row of an
episode gets the episode's reward and its group id.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from hyperrl.tokenizer import TokenizerError, encode_prompt, encode_text, observation_ids
from hyperrl.trajectory import NO_VERSION

__all__ = ["Chain", "EpisodeRecord", "Prompt", "normalize_message", "render_messages"]


def _text(content) -> str:
    """An OpenAI ``content``: a string, None, or a list of ``{"type": "text", "text": …}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("messages: a content part must be {'type': 'text', 'text': str} (this gateway "
                                 "serves text models)")
            parts.append(p["text"])
        return "".join(parts)
    raise ValueError(f"messages: content must be a string, a list of text parts or null, not {type(content).__name__}")


def _arguments(args):
    """A tool call's ``arguments``: OpenAI sends a JSON string; templates take the object."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args  # kept as the text the agent sent (it still renders, and compares, as itself)
    return args


def normalize_message(m) -> dict:
    """An OpenAI message as the chat template takes it and as extension compares it: ``role``,
    ``content`` as text, ``tool_calls`` as ``{"type": "function", "function": {"name", "arguments"
    (an object)}}`` without their ids, ``name`` and ``tool_call_id`` when present. Extra fields a client
    echoes (``refusal``, ``annotations``, a call's ``id``) do not make a message differ."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages: each message needs a 'role' string (got {str(m)[:80]!r})")
    out = {"role": m["role"], "content": _text(m.get("content"))}
    calls = m.get("tool_calls")
    if calls:
        norm = []
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError("messages: a tool call needs {'function': {'name': str, 'arguments': …}}")
            norm.append({"type": "function", "function": {"name": fn["name"],
                                                          "arguments": _arguments(fn.get("arguments", {}))}})
        out["tool_calls"] = norm
    for k in ("name", "tool_call_id"):
        if isinstance(m.get(k), str):
            out[k] = m[k]
    return out


def render_messages(tok, messages: list[dict], tools: list | None) -> list[int]:
    """A whole conversation's prompt ids through the chat template (with the generation prompt)."""
    return encode_prompt(tok, messages, tools=tools or None)


@dataclass
class Chain:
    """One row being built: ``tokens`` with ``action`` (sampled by the policy), ``logprobs`` and
    ``versions`` per token; what the agent saw — ``messages`` + ``reply`` (chat) or ``text``
    (completions) — decides which later calls extend it."""

    tokens: list[int]
    action: list[bool]
    logprobs: list[float]
    versions: list[int]
    kind: str  # "chat" | "completion"
    messages: list[dict] = field(default_factory=list)
    tools: list | None = None
    reply: dict | None = None  # the normalised assistant message returned for the last turn
    text: str = ""  # completions: prompt text + returned completion text
    finish_reason: str = "stop"
    turns: int = 0
    tool_calls: int = 0  # calls the model made in this chain's turns

    def final_turn(self) -> int:
        """The index of the first token of the last sampled turn (0 when none was sampled)."""
        end = max((i for i, a in enumerate(self.action) if a), default=-1)
        start = end
        while start > 0 and self.action[start - 1]:
            start -= 1
        return max(start, 0)

    @property
    def last_action(self) -> list[int]:
        """The ids of the last sampled turn (the chain ends with it between calls)."""
        return self.tokens[self.final_turn():] if any(self.action) else []

    def copy_as_context(self) -> Chain:
        """The same tokens with every action turned into context (a fork's shared prefix)."""
        c = copy.deepcopy(self)
        c.action = [False] * len(c.tokens)
        c.logprobs = [0.0] * len(c.tokens)
        c.versions = [NO_VERSION] * len(c.tokens)
        return c


@dataclass(frozen=True)
class Prompt:
    """A call's prompt: its ``ids``, the chain it continues (None: a new chain) and what to remember."""

    ids: list[int]
    chain: Chain | None
    new: list[int]  # the ids appended to the chain (all of ``ids`` for a new chain)
    messages: list[dict] | None = None
    tools: list | None = None
    text: str = ""


class EpisodeRecord:
    """The chains of one episode (see the module doc)."""

    def __init__(self, tokenizer, render=None):
        self.tok = tokenizer
        self.render = render or (lambda msgs, tools: render_messages(tokenizer, msgs, tools))
        self.chains: list[Chain] = []
        self.log: list[dict] = []  # every call: prompt ids, and per choice the sampled ids, log-probs, versions, finish
        self.calls = 0
        self.rewrites = 0  # calls that could not extend a chain although one existed

    # ------------------------------------------------------------------ chat
    def chat_prompt(self, messages: list, tools: list | None) -> Prompt:
        """The prompt ids of a chat call (``messages`` as the client sent them)."""
        msgs = [normalize_message(m) for m in messages]
        if not msgs:
            raise ValueError("messages: empty; a chat call needs at least one message")
        for c in reversed(self.chains):
            k = len(c.messages)
            if (c.kind == "chat" and c.reply is not None and c.tools == tools and len(msgs) > k
                    and msgs[:k] == c.messages and _same_reply(msgs[k], c.reply)):
                try:
                    new = observation_ids(self.tok, msgs[:k + 1], c.last_action, msgs[k + 1:], tools=tools)
                except TokenizerError:  # a template that is not prefix-stable here: a new chain (counted)
                    break
                return Prompt(c.tokens + new, c, new, msgs, tools)
        if self.chains:
            self.rewrites += 1
        ids = list(self.render(msgs, tools))
        return Prompt(ids, None, ids, msgs, tools)

    # ------------------------------------------------------------------ completions
    def completion_prompt(self, prompt) -> Prompt:
        """The prompt ids of a completions call: ``prompt`` as ids (token-in) or as text."""
        if isinstance(prompt, list):
            ids = [int(i) for i in prompt]
            for c in reversed(self.chains):
                if c.kind == "completion" and len(ids) >= len(c.tokens) and ids[:len(c.tokens)] == c.tokens:
                    return Prompt(ids, c, ids[len(c.tokens):])
            if self.chains:
                self.rewrites += 1
            return Prompt(ids, None, ids)
        for c in reversed(self.chains):
            if c.kind == "completion" and c.text and prompt.startswith(c.text):
                new = encode_text(self.tok, prompt[len(c.text):])
                return Prompt(c.tokens + new, c, new, text=prompt)
        if self.chains:
            self.rewrites += 1
        ids = encode_text(self.tok, prompt, special=True)
        return Prompt(ids, None, ids, text=prompt)

    # ------------------------------------------------------------------ recording
    def record(self, p: Prompt, choices: list[dict], *, kind: str) -> None:
        """Add a call's sampled ``choices`` (each ``ids``, ``logprobs``, ``versions``, ``finish_reason``
        and, for chat, ``reply`` — the normalised assistant message returned — or, for completions,
        ``text``): the first continues ``p.chain`` (or starts one), the others fork (module doc)."""
        self.calls += 1
        self.log.append({"kind": kind, "prompt_ids": list(p.ids), "extends": p.chain is not None,
                         "choices": [{k: list(ch[k]) if isinstance(ch[k], list) else ch[k]
                                      for k in ("ids", "logprobs", "versions", "finish_reason")} for ch in choices]})
        chain = p.chain
        if chain is not None and len(chain.tokens) + len(p.new) != len(p.ids):
            chain = None  # another call extended the chain after this one's prompt was made: a row of its own
        if chain is not None:
            base = chain
            base.tokens, base.action = base.tokens + p.new, base.action + [False] * len(p.new)
            base.logprobs, base.versions = base.logprobs + [0.0] * len(p.new), base.versions + [NO_VERSION] * len(p.new)
        else:
            base = Chain(list(p.ids), [False] * len(p.ids), [0.0] * len(p.ids), [NO_VERSION] * len(p.ids), kind)
            self.chains.append(base)
        prefix = base.copy_as_context() if len(choices) > 1 else None
        for j, ch in enumerate(choices):
            c = base if j == 0 else copy.deepcopy(prefix)
            if j:
                self.chains.append(c)
            c.tokens += ch["ids"]
            c.action += [True] * len(ch["ids"])
            c.logprobs += list(ch["logprobs"])
            c.versions += list(ch["versions"])
            c.finish_reason, c.turns = ch["finish_reason"], c.turns + 1
            if kind == "chat":
                c.tool_calls += len(ch["reply"].get("tool_calls") or [])
                c.messages, c.tools, c.reply = list(p.messages), p.tools, ch["reply"]
            else:
                c.text = p.text + ch["text"] if p.text else ""  # a prompt given as ids extends by ids only

    def rows(self) -> list[Chain]:
        """The chains that sampled at least one token (a chain of context alone trains nothing)."""
        return [c for c in self.chains if any(c.action)]


def _same_reply(sent: dict, returned: dict) -> bool:
    """The client echoed the assistant reply the gateway returned (text and tool calls equal)."""
    return (sent.get("role") == "assistant" and sent.get("content", "").strip() == returned.get("content", "").strip()
            and sent.get("tool_calls") == returned.get("tool_calls"))
