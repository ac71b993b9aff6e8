"""An OpenAI- and Anthropic-compatible gateway in front of any hyperrl engine, recording every call's exact tokens.

An agent that owns its loop reaches the policy over HTTP, as it would reach OpenAI or Anthropic: each
episode gets its own base URL ``http://127.0.0.1:PORT/episodes/<id>/v1`` and key (``Authorization:
Bearer …`` or ``x-api-key: …``). Served: ``POST /v1/chat/completions`` (``messages``, ``tools`` /
``tool_choice``, ``n``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``,
``logprobs``, ``stream`` with ``stream_options.include_usage``), ``POST /v1/completions`` (a text prompt,
or token ids: token-in), ``GET /v1/models``, OpenAI's Responses API ``POST /v1/responses``
(:mod:`hyperrl.agents.responses_api`) and Anthropic's Messages API ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (:mod:`hyperrl.agents.messages_api`; the Anthropic client's base URL is the
episode's without ``/v1``), each streamed or not. Every protocol becomes the same chat turn — the same
row rule, the same recording; a stream is written from the finished turn (what is sampled never depends
on it), and a client that leaves a stream early leaves the call recorded whole, marked ``abandoned``
(counted: ``agent_abandoned_streams``). Messages
are rendered by the model's chat template (with the tools' JSON schemas); the model's calls in its
native format (``tool_format``: a :data:`hyperrl.envs.TOOL_FORMATS` name) come back as OpenAI
``tool_calls``; a malformed call comes back as the model's text (an observation the agent sees,
counted), never an error. Every call's prompt ids, sampled ids, log-probs, per-token versions and
finish reason go into the episode's :class:`~hyperrl.agents.record.EpisodeRecord` (token-in-token-out:
the rule is there).

**Sampling belongs to the run.** In a training episode (``training=True``) the run's temperature and
top-p sample every call — the log-probs must be of the distribution the trainer recomputes — and a
request asking for others is served at the run's values (counted as ``overridden``); ``max_tokens``
is honoured up to ``rollout.max_new_tokens``. ``training=False`` (serving, evaluation) honours them.
``top_logprobs`` is refused with a 400 (not served here).

Calls are batched: a dispatcher thread takes the pending calls when every open episode has one
pending, or ``batch_wait_s`` after the last arrived, and runs them as one engine call per set of
sampling parameters — keyed by ``(seed, a key of (episode uid, call, choice), token index)`` on an
engine whose ``capabilities.keyed`` is set, so what an episode samples does not depend on what else
was batched with it. An episode opened with ``submit`` (the asynchronous trainer's) does not call the
engine: its calls go to ``submit(requests, done)`` — the rollout workers' queue — and ``done(rows)``
answers them when the rows are generated (a publication may interrupt a call; it resumes under the
new weights, its tokens stamped with their versions).

aiohttp serves it (why: one well-kept package that is both the HTTP server and nothing more — no
ASGI server + framework pair to keep in step — running its own event loop in a background thread of
the trainer's process, next to the engine it serves; the request bodies are checked here, each
error naming its field as OpenAI's do). Binds ``127.0.0.1`` by default; ``host`` / ``port`` bind elsewhere
for agents in containers or on other machines (``public_url``: the address they use, e.g. behind a port
mapping). Every episode's key is random (``secrets``), compared in constant time, never logged nor echoed
in an error, and dead when its episode ends (its URL answers 404).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import json
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hyperrl.agents import messages_api, responses_api
from hyperrl.agents.limits import RENDER_CACHE_BYTES, BodyError, RenderCache, body_bound, parse_body, schema_problem
from hyperrl.agents.record import EpisodeRecord, Prompt, normalize_message
from hyperrl.agents.streams import SSE, chat_chunks
from hyperrl.envs.tools import TOOL_FORMATS, resolve_call
from hyperrl.errors import HyperRLError
from hyperrl.rollout.requests import Request, call_key
from hyperrl.sampling import SamplingParams
from hyperrl.tokenizer import TokenizerError, decode_response

__all__ = ["Gateway", "GatewayEpisode", "GatewayError", "call_key"]


class GatewayError(HyperRLError):
    """An HTTP error with OpenAI's body: ``status``, ``message``, ``type``, ``param``, ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GatewayEpisode:
    """One episode's endpoint: ``base_url`` and ``api_key`` for the agent's client, and its record."""

    id: str
    api_key: str
    base_url: str
    uid: int
    record: EpisodeRecord
    sampling: SamplingParams | None = None  # this round's (temperature, top-p, seed; max_new_tokens caps calls)
    calls: int = 0  # calls answered
    started: int = 0  # calls begun (keys each call's sampling)
    malformed_tool_calls: int = 0
    overridden: int = 0
    errors: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # requests answered 4xx (an unsupported field, a bad body, …)
    abandoned_streams: int = 0  # streamed answers the client left before their end (the call is recorded whole)
    stored: dict = field(default_factory=dict)  # Responses API: response id → its history (previous_response_id)
    last_logged: int | None = None  # the record entry of the call answered last (a stream marks it if abandoned)
    finished: bool = False
    submit: Callable | None = None  # the asynchronous trainer's queue (None: the gateway calls the engine)


@dataclass(eq=False)
class _Job:
    episode: GatewayEpisode
    prompt: Prompt
    sampling: SamplingParams
    n: int
    call: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _bad(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param=param)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise _bad(key, f"{v!r} must be an integer in [{lo}, {hi if hi is not None else '∞'}]")
    return v


def _float(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        raise _bad(key, f"{v!r} must be a number in [{lo}, {hi}]")
    return float(v)


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 4:
        raise _bad("stop", "a non-empty string or a list of at most 4 of them")
    return v


OFF_LOOP_CHARS = 32_768  # a prompt's characters past which it is rendered off the event loop


def _size(messages, tools) -> int:
    """About how many characters ``messages`` and ``tools`` render to (string contents; anything else as printed)."""
    n = sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else len(str(m))
            for m in messages or [])
    return n + (len(str(tools)) if tools else 0)


def _tools(body: dict) -> tuple[list | None, list[str]]:
    tools = body.get("tools")
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of {'type': 'function', 'function': {...}}")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': str, 'parameters': {...}}}")
        if "parameters" in fn and (why := schema_problem(fn["parameters"])):
            raise _bad(f"tools[{i}].function.parameters", why)
        names.append(fn["name"])
    return (tools or None), names


def _tool_choice(body: dict, names: list[str]) -> str:
    v = body.get("tool_choice", "auto")
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and isinstance(v.get("function"), dict) and v["function"].get("name") in names:
        return "auto"  # recorded as asked; sampling is never constrained (it would change what the log-probs describe)
    raise _bad("tool_choice", f"{v!r}: one of 'auto', 'none', 'required' or a function offered in tools")


def _cut(out: dict, n: int) -> dict:
    """A choice's first ``n`` sampled tokens (a stop string met earlier)."""
    return {**out, "ids": out["ids"][:n], "logprobs": out["logprobs"][:n], "versions": out["versions"][:n]}


def _cut_at_stop(tok, ids: list[int], stops: list[str], sp: SamplingParams) -> tuple[list[int], str, str | None]:
    """The sampled ids up to the first token whose text completes a stop string, the text before it,
    and the stop string met (None: none; vLLM's semantics: the ids keep the stop, the text does not)."""
    text = decode_response(tok, ids, sp.stops)
    if not stops:
        return ids, text, None
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return ids, text, None
    at, s = min(hits)
    for k in range(1, len(ids) + 1):  # the shortest prefix whose text holds the stop
        if len(decode_response(tok, ids[:k], sp.stops)) >= at + len(s):
            return ids[:k], text[:at], s
    return ids, text[:at], s


class Gateway:
    """The gateway over ``engine`` (see the module doc). ``sampling``: the run's sampling parameters
    (the seed keys a keyed engine; ``max_new_tokens`` caps every call); ``tool_format``: the model's
    tool-call format (None: tool calls are not parsed); ``max_model_len``: the context a prompt
    plus its response must fit; ``max_episode_tokens``: a chain's token budget (None: the context)."""

    def __init__(self, engine, tokenizer, sampling: SamplingParams, *, tool_format: str | None = "hermes",
                 model_name: str = "hyperrl-policy", max_model_len: int = 4096, max_episode_tokens: int | None = None,
                 training: bool = True, host: str = "127.0.0.1", port: int = 0, batch_wait_s: float = 0.002,
                 max_batch: int = 256, public_url: str | None = None):
        self.engine, self.tok, self.sampling = engine, tokenizer, sampling
        self.format = TOOL_FORMATS.build(tool_format)() if tool_format is not None else None
        self.model_name, self.max_model_len, self.training = model_name, max_model_len, training
        self.max_episode_tokens = max_episode_tokens or max_model_len
        self.host, self.batch_wait_s, self.max_batch = host, batch_wait_s, max_batch
        self.public_url = public_url.rstrip("/") if public_url else None
        self.episodes: dict[str, GatewayEpisode] = {}
        self.engine_calls = self.engine_rows = 0  # batching: rows per engine call = engine_rows / engine_calls
        # a group's n episodes open with the same messages: their prompt is rendered once (the cache holds what
        # was served — a refused prompt is never kept — and at most RENDER_CACHE_BYTES of it)
        self._renders = RenderCache(RENDER_CACHE_BYTES)
        self._render = lambda msgs, tools: self._renders.render(tokenizer, msgs, tools)
        # no request body may be larger than the context can hold (checked before it is parsed or rendered)
        self.max_body = body_bound(tokenizer, max_model_len)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="hyperrl-gateway-render")  # renders off the loop
        self._lock = threading.Lock()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._waiting: set[_Job] = set()  # calls submitted to a queue, not answered yet (failed at close)
        self._closed = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server = threading.Thread(target=self._serve, args=(port,), name="hyperrl-gateway", daemon=True)
        self._server.start()
        self._ready.wait(30)
        if self._error is not None or not self._ready.is_set():
            raise RuntimeError(f"gateway: could not listen on {host}:{port}: {self._error!r}")
        self._dispatcher = threading.Thread(target=self._dispatch, name="hyperrl-gateway-dispatch", daemon=True)
        self._dispatcher.start()

    # ------------------------------------------------------------------ episodes
    @property
    def url(self) -> str:
        """Where agents reach the gateway: ``public_url`` when given (a container's or another host's way in),
        else the bound address (a wildcard bind is named by this machine's host name)."""
        if self.public_url:
            return self.public_url
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def open(self, uid: int, *, sampling: SamplingParams | None = None, submit: Callable | None = None
             ) -> GatewayEpisode:
        """A new episode (``uid``: the sample_uid keying its sampling; ``sampling``: this round's
        parameters — a training round's or an evaluation's — default the gateway's; ``submit``: where
        its calls go instead of the engine — ``submit(requests, done)``, ``done(rows)`` once they are
        generated, a row per request in order)."""
        eid = uuid.uuid4().hex
        ep = GatewayEpisode(eid, secrets.token_urlsafe(24), f"{self.url}/episodes/{eid}/v1", int(uid),
                            EpisodeRecord(self.tok, self._render), sampling=sampling or self.sampling, submit=submit)
        with self._lock:
            self.episodes[eid] = ep
        return ep

    def finish(self, episode: GatewayEpisode) -> GatewayEpisode:
        """Close ``episode`` (later calls get 404) and return it with its record."""
        with self._lock:
            episode.finished = True
            self.episodes.pop(episode.id, None)
        return episode

    def finish_all(self) -> None:
        """Close every open episode (a cancelled round: the agents' next calls get 404)."""
        with self._lock:
            open_ = list(self.episodes.values())
        for ep in open_:
            self.finish(ep)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._dispatcher.join(10)
        with self._lock:
            waiting, self._waiting = list(self._waiting), set()
        while not self._jobs.empty():  # calls the dispatcher never took
            waiting.append(self._jobs.get_nowait())
        for j in waiting:  # a queue that stopped (the trainer closing) answers nobody: the calls end now
            j.loop.call_soon_threadsafe(_fail, j.future, GatewayError(503, "the run is closing", type="server_error"))
        if self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            try:
                fut.result(10)
            except (TimeoutError, concurrent.futures.TimeoutError):  # handlers still draining: stop regardless
                pass
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
        self._server.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ HTTP
    def _serve(self, port: int) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=self.max_body)
        app.router.add_get("/episodes/{eid}/v1/models", self._wrap(self._models))
        app.router.add_post("/episodes/{eid}/v1/chat/completions", self._wrap(self._chat))
        app.router.add_post("/episodes/{eid}/v1/completions", self._wrap(self._completions))
        app.router.add_post("/episodes/{eid}/v1/responses", self._wrap(self._responses))
        app.router.add_post("/episodes/{eid}/v1/messages", self._wrap(self._messages, anthropic=True))
        app.router.add_post("/episodes/{eid}/v1/messages/count_tokens", self._wrap(self._count_tokens, anthropic=True))

        async def start():
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, port)
            await site.start()
            self.port = self._runner.addresses[0][1]

        try:
            self._loop.run_until_complete(start())
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def _wrap(self, handler, *, anthropic: bool = False):
        """An aiohttp handler: the episode and its key checked, the JSON body read, the answer written — JSON,
        or a server-sent event stream — and errors in the protocol's own body (OpenAI's, or Anthropic's with
        ``anthropic``)."""
        from aiohttp import web

        def error(e: GatewayError):
            if anthropic:
                kind = {401: "authentication_error", 404: "not_found_error", 500: "api_error",
                        503: "overloaded_error"}.get(e.status, "invalid_request_error")
                return web.json_response({"type": "error", "error": {"type": kind, "message": e.message}},
                                         status=e.status)
            return web.json_response(e.body(), status=e.status)

        async def run(request):
            try:
                ep = self._episode(request)
                try:
                    body = parse_body(await request.read()) if request.method == "POST" else {}
                except BodyError as e:
                    raise _bad("body", str(e)) from None
                out = await handler(ep, body)
                if isinstance(out, SSE):
                    out.episode, out.log_index = ep, ep.last_logged
                    return await self._stream(request, out)
                return web.json_response(out)
            except web.HTTPRequestEntityTooLarge:
                e = GatewayError(413, f"body: larger than the {self.max_body} bytes a request can take here (a "
                                      f"prompt within the context of {self.max_model_len} tokens fits in fewer)",
                                 param="body", code="request_too_large")
                ep.refused.append(f"{request.method} {request.path}: 413 {e.message}")
                return error(e)
            except GatewayError as e:
                if "ep" in locals() and e.status < 500:  # a known episode's request refused (agent_refused_requests)
                    ep.refused.append(f"{request.method} {request.path}: {e.status} {e.message}")
                return error(e)
            except Exception as e:  # noqa: BLE001 - the agent gets a 500 naming it; the episode records it
                if "ep" in locals():
                    ep.errors.append(f"{type(e).__name__}: {e}")
                return error(GatewayError(500, f"{type(e).__name__}: {e}", type="server_error"))
        return run

    async def _stream(self, request, out: SSE):
        """Write ``out``'s events as server-sent events; a client that leaves before the end marks the call's
        record entry ``abandoned`` (counted) — its row is kept whole: it was sampled before the first byte."""
        from aiohttp import web

        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            # the turn is finished: its events go out in one write (a client reads them one by one all the same)
            text = "".join((f"event: {ev['type']}\n" if out.named else "") + f"data: {json.dumps(ev)}\n\n"
                           for ev in out.events)
            await resp.write((text + ("data: [DONE]\n\n" if out.done else "")).encode())
            await resp.write_eof()
        except (ConnectionError, RuntimeError) as e:  # aiohttp's ClientConnectionResetError is a ConnectionError
            if out.episode is not None:
                out.episode.abandoned_streams += 1
                if out.log_index is not None:
                    out.episode.record.log[out.log_index]["abandoned"] = True
            if not isinstance(e, ConnectionError) and "closing" not in str(e):
                raise
        return resp

    def _episode(self, request) -> GatewayEpisode:
        eid = request.match_info["eid"]
        with self._lock:
            ep = self.episodes.get(eid)
        if ep is None or ep.finished:
            raise GatewayError(404, f"episode {eid!r} is unknown or finished; each episode has its own base URL",
                               code="episode_not_found")
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(), ep.api_key.encode()):
            raise GatewayError(401, "invalid API key for this episode (use the key given with its base URL, as "
                                    "'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                               code="invalid_api_key", type="authentication_error")
        return ep

    async def _off_loop(self, size: int, fn, *args):
        """``fn(*args)`` — on the render threads when ``size`` (characters) passes :data:`OFF_LOOP_CHARS`, else here:
        for a short prompt the thread hop (the loop waiting its turn for the GIL) costs more than the render."""
        if size < OFF_LOOP_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _models(self, ep: GatewayEpisode, body: dict) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "hyperrl"}]}

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model != self.model_name:
            raise GatewayError(404, f"model {model!r} is not served here; this gateway serves {self.model_name!r}",
                               param="model", code="model_not_found")

    def _sampling(self, ep: GatewayEpisode, prompt_len: int, want: int | None, temperature: float | None,
                  top_p: float | None) -> SamplingParams:
        """A call's sampling parameters: the round's, ``want`` new tokens at most (within the context and the
        episode's budget); a request's temperature and top-p are honoured only outside training (counted as
        ``overridden`` when a training call asks for others)."""
        room = min(self.max_model_len, self.max_episode_tokens) - prompt_len
        if room < 1:
            which = "the context" if self.max_model_len <= self.max_episode_tokens else "the episode's token budget"
            raise _bad("messages", f"the prompt has {prompt_len} tokens, which leaves no room in {which} "
                                   f"({min(self.max_model_len, self.max_episode_tokens)} tokens)")
        sp = ep.sampling
        new = min(sp.max_new_tokens, want or sp.max_new_tokens, room)
        t, p = sp.temperature, sp.top_p
        if not self.training:
            t, p = temperature if temperature else t, top_p if top_p else p
        elif (temperature is not None and temperature != t) or (top_p is not None and top_p != p):
            ep.overridden += 1
        return dataclasses.replace(sp, max_new_tokens=new, temperature=t, top_p=p)

    @staticmethod
    def _openai_sampling(body: dict, budget_key: str = "max_tokens") -> dict:
        """The sampling fields of an OpenAI request (``top_logprobs`` refused: not served)."""
        if _int(body, "top_logprobs", 0, 20):
            raise _bad("top_logprobs", "not served (the engine returns the sampled tokens' log-probs only); omit it")
        want = _int(body, "max_completion_tokens", 1) or _int(body, budget_key, 1)
        return {"want": want, "temperature": _float(body, "temperature", 0.0, 2.0),
                "top_p": _float(body, "top_p", 0.0, 1.0)}

    async def _turn(self, ep: GatewayEpisode, sampling: dict, messages: list, tools: list | None, choice: str,
                    n: int, stops: list[str]) -> tuple[Prompt, list[dict]]:
        """A chat turn, whatever the protocol: the prompt (extending a chain when the messages do) and ``n``
        sampled choices, each with ``content`` (the text without the tool calls), ``calls`` (``(name,
        arguments)``, parsed from the model's native format), ``reply`` (the normalised assistant message the
        chain remembers) and ``stop`` (the stop string met, or None)."""
        names = [t["function"]["name"] for t in tools or []]
        try:  # a long prompt is rendered and tokenised on a thread: it never holds the other episodes' calls
            prompt = await self._off_loop(_size(messages, tools), ep.record.chat_prompt, messages, tools)
        except ValueError as e:  # a malformed message, or one the template cannot render
            raise _bad("messages", str(e).removeprefix("messages: ")) from None
        except Exception as e:  # noqa: BLE001 - a template error (jinja) is the request's fault
            raise _bad("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from None
        recorded = await self._sample(ep, sampling, prompt, n, stops)
        if prompt.chain is None and prompt.messages is not None:  # served: a group's other episodes reuse it
            self._renders.keep(prompt.messages, prompt.tools, prompt.ids)
        for o in recorded:
            calls = self._calls(ep, o["text"], names) if self.format is not None and names and choice != "none" \
                else None
            o["content"], o["calls"] = (self.format.strip(o["text"]) if calls else o["text"]), calls or []
            reply = {"role": "assistant", "content": o["content"]}
            if calls:
                reply["tool_calls"] = [{"type": "function", "function": {"name": nm, "arguments": args}}
                                       for nm, args in calls]
            o["reply"] = normalize_message(reply)
        return prompt, recorded

    async def _chat(self, ep: GatewayEpisode, body: dict):
        self._check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "must be a non-empty list of messages")
        stream, include_usage = self._stream_options(body)
        tools, names = _tools(body)
        choice = _tool_choice(body, names)
        n, stops = _int(body, "n", 1, 16) or 1, _stops(body)
        prompt, recorded = await self._turn(ep, self._openai_sampling(body), messages, tools, choice, n, stops)
        choices = []
        for j, o in enumerate(recorded):
            msg = {"role": "assistant", "content": o["content"] or None, "refusal": None}
            if o["calls"]:
                msg["tool_calls"] = [{"id": f"call_{ep.id[:8]}_{ep.calls}_{j}_{k}", "type": "function",
                                      "function": {"name": nm, "arguments": json.dumps(args)}}
                                     for k, (nm, args) in enumerate(o["calls"])]
            choices.append({"index": j, "message": msg, "finish_reason": "tool_calls" if o["calls"] else
                            o["finish_reason"], "logprobs": self._logprobs(o["ids"], o["logprobs"])
                            if body.get("logprobs") else None})
        out = self._end_call(ep, prompt, recorded, "chat", choices)
        return SSE(chat_chunks(out, include_usage), done=True) if stream else out

    @staticmethod
    def _stream_options(body: dict) -> tuple[bool, bool]:
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise _bad("stream", "must be a boolean")
        opts = body.get("stream_options")
        if opts is not None and (not stream or not isinstance(opts, dict)):
            raise _bad("stream_options", "only with stream=true, an object ({'include_usage': bool})")
        return stream, bool((opts or {}).get("include_usage"))

    async def _completions(self, ep: GatewayEpisode, body: dict) -> dict:
        self._check_model(body)
        if body.get("stream"):
            raise _bad("stream", "streaming is served for chat completions, responses and messages, not for "
                                 "completions; set stream=false")
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
            raw = raw[0]  # a one-prompt batch
        if isinstance(raw, list):
            if not raw or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(self.tok)
                                  for i in raw):
                raise _bad("prompt", f"token ids must be a non-empty list of integers in [0, {len(self.tok)})")
        elif not isinstance(raw, str):
            raise _bad("prompt", "a string or a list of token ids (one prompt per call)")
        n, stops = _int(body, "n", 1, 16) or 1, _stops(body)
        try:
            prompt = ep.record.completion_prompt(raw)
        except TokenizerError as e:
            raise _bad("prompt", str(e)) from None
        recorded = await self._sample(ep, self._openai_sampling(body), prompt, n, stops)
        choices = []
        for j, o in enumerate(recorded):
            lp = self._logprobs(o["ids"], o["logprobs"]) if body.get("logprobs") else None
            if lp is not None:  # the legacy completions shape
                lp = {"tokens": [c["token"] for c in lp["content"]], "top_logprobs": None, "text_offset": None,
                      "token_logprobs": [c["logprob"] for c in lp["content"]]}
            choices.append({"index": j, "text": o["text"], "finish_reason": o["finish_reason"], "logprobs": lp})
        return self._end_call(ep, prompt, recorded, "completion", choices)

    async def _responses(self, ep: GatewayEpisode, body: dict):
        """``POST /v1/responses`` (:mod:`hyperrl.agents.responses_api`)."""
        self._check_model(body)
        try:
            history = None
            prev = body.get("previous_response_id")
            if prev is not None:
                history = ep.stored.get(prev)
                if history is None:
                    raise GatewayError(404, f"previous_response_id {prev!r}: no response of this episode stored "
                                            "under it (one sent with store=false is not kept)",
                                       param="previous_response_id", code="previous_response_not_found")
            messages, turn = responses_api.request_messages(body, history)
            tools = responses_api.request_tools(body)
            choice = responses_api.request_tool_choice(body, [t["function"]["name"] for t in tools or []])
        except responses_api.RequestError as e:
            raise _bad(e.param, str(e).split(": ", 1)[1]) from None
        stream, _ = self._stream_options({k: v for k, v in body.items() if k != "stream_options"})
        sampling = {"want": _int(body, "max_output_tokens", 1), "temperature": _float(body, "temperature", 0.0, 2.0),
                    "top_p": _float(body, "top_p", 0.0, 1.0)}
        prompt, recorded = await self._turn(ep, sampling, messages, tools, choice, 1, [])
        o = recorded[0]
        rid = f"{ep.id[:12]}{ep.calls}"
        items = responses_api.output_items(rid, o["content"], o["calls"])
        usage = self._record(ep, prompt, recorded, "chat")
        resp = responses_api.response_object(rid, self.model_name, int(time.time()), body, items,
                                             incomplete=o["finish_reason"] == "length" and not o["calls"], **usage)
        if body.get("store", True) is not False:
            ep.stored[resp["id"]] = responses_api.history_of(turn, items, history)
        return SSE(responses_api.stream_events(resp), named=True) if stream else resp

    async def _messages(self, ep: GatewayEpisode, body: dict):
        """``POST /v1/messages`` (:mod:`hyperrl.agents.messages_api`)."""
        self._check_model(body)
        try:
            messages = messages_api.request_messages(body)
            tools = messages_api.request_tools(body)
            choice = messages_api.request_tool_choice(body, [t["function"]["name"] for t in tools or []])
        except messages_api.RequestError as e:
            raise _bad(e.param, str(e).split(": ", 1)[1]) from None
        stops = body.get("stop_sequences") or []
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise _bad("stop_sequences", "must be a list of non-empty strings")
        stream, _ = self._stream_options(body)
        sampling = {"want": body["max_tokens"], "temperature": _float(body, "temperature", 0.0, 1.0),
                    "top_p": _float(body, "top_p", 0.0, 1.0)}
        _int(body, "top_k", 0)
        prompt, recorded = await self._turn(ep, sampling, messages, tools, choice, 1, stops)
        o = recorded[0]
        mid = f"{ep.id[:12]}{ep.calls}"
        blocks = messages_api.content_blocks(mid, o["content"], o["calls"])
        usage = self._record(ep, prompt, recorded, "chat")
        msg = messages_api.message_object(mid, self.model_name, blocks,
                                          messages_api.stop_reason(bool(o["calls"]), o["finish_reason"], o["stop"]),
                                          o["stop"] if not o["calls"] else None, **usage)
        return SSE(messages_api.stream_events(msg), named=True) if stream else msg

    async def _count_tokens(self, ep: GatewayEpisode, body: dict) -> dict:
        """``POST /v1/messages/count_tokens``: the prompt's tokens as the chat template renders it."""
        self._check_model(body)
        try:
            messages = messages_api.request_messages({**body, "max_tokens": 1})
            tools = messages_api.request_tools(body)
        except messages_api.RequestError as e:
            raise _bad(e.param, str(e).split(": ", 1)[1]) from None
        try:
            ids = await self._off_loop(_size(messages, tools), self._render, [normalize_message(m) for m in messages],
                                       tools)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise _bad("messages", f"the chat template cannot render them: {type(e).__name__}: {e}") from None
        return {"input_tokens": len(ids)}

    async def _sample(self, ep: GatewayEpisode, sampling: dict, prompt: Prompt, n: int, stops: list[str]) -> list[dict]:
        """``n`` choices for ``prompt`` at the call's sampling parameters, each cut at the first stop
        string: its ``ids``, ``logprobs``, ``versions``, ``text``, ``finish_reason`` and ``stop`` (met)."""
        sp = self._sampling(ep, len(prompt.ids), **sampling)
        out = []
        for o in await self._generate(ep, prompt, sp, n):
            ids, text, hit = _cut_at_stop(self.tok, o["ids"], stops, sp)
            out.append({**_cut(o, len(ids)), "text": text, "stop": hit,
                        "finish_reason": "stop" if hit is not None else o["finish_reason"]})
        return out

    def _record(self, ep: GatewayEpisode, prompt: Prompt, recorded: list[dict], kind: str) -> dict:
        """Record the call (unless its episode was closed meanwhile — a timed-out agent's call adds nothing);
        its token counts."""
        ep.last_logged = None
        if not ep.finished:
            ep.record.record(prompt, recorded, kind=kind)
            ep.last_logged = len(ep.record.log) - 1
        ep.calls += 1
        return {"input_tokens": len(prompt.ids), "output_tokens": sum(len(r["ids"]) for r in recorded)}

    def _end_call(self, ep: GatewayEpisode, prompt: Prompt, recorded: list[dict], kind: str, choices: list) -> dict:
        """Record the call and answer it in OpenAI's chat / completions shape."""
        usage = self._record(ep, prompt, recorded, kind)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{ep.id[:12]}-{ep.calls}",
                "object": obj, "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
                          "total_tokens": usage["input_tokens"] + usage["output_tokens"]}}

    def _calls(self, ep: GatewayEpisode, text: str, names: list[str]) -> list[tuple[str, object]] | None:
        """The model's tool calls in its format; a malformed one returns the whole text as content
        (the agent sees what the model wrote) and is counted."""
        payloads = self.format.parse(text)
        if not payloads:
            return None
        calls = [resolve_call(p, self.format, names) for p in payloads]
        if any(isinstance(c, str) for c in calls):
            ep.malformed_tool_calls += 1
            return None
        return calls

    def _logprobs(self, ids: list[int], lps: list[float]) -> dict:
        out = []
        for i, lp in zip(ids, lps):
            t = self.tok.decode([i], skip_special_tokens=False)
            out.append({"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []})
        return {"content": out}

    # ------------------------------------------------------------------ batching
    async def _generate(self, ep: GatewayEpisode, prompt: Prompt, sp: SamplingParams, n: int) -> list[dict]:
        loop = asyncio.get_running_loop()
        job = _Job(ep, prompt, sp, n, ep.started, loop.create_future(), loop)
        ep.started += 1
        self._jobs.put(job)
        return await job.future

    def _waiting_for_all(self, pending: int) -> bool:
        with self._lock:
            return pending >= len(self.episodes)

    def _dispatch(self) -> None:
        while not self._closed.is_set():
            try:
                jobs = [self._jobs.get(timeout=0.1)]
            except queue.Empty:
                continue
            deadline = time.monotonic() + self.batch_wait_s
            while len(jobs) < self.max_batch and not self._waiting_for_all(len(jobs)):
                try:
                    jobs.append(self._jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                    deadline = time.monotonic() + self.batch_wait_s
                except queue.Empty:
                    break
            for j in [j for j in jobs if j.episode.submit is not None]:  # the asynchronous trainer's queue
                self._submit(j)
            groups: dict[SamplingParams, list[_Job]] = {}
            for j in jobs:
                if j.episode.submit is None:
                    groups.setdefault(j.sampling, []).append(j)
            for sp, group in groups.items():
                try:
                    outs = self._run(group, sp)
                except BaseException as e:  # noqa: BLE001 - every waiting call gets the error
                    for j in group:
                        j.loop.call_soon_threadsafe(_fail, j.future, e)
                    continue
                for j, o in zip(group, outs):
                    j.loop.call_soon_threadsafe(_resolve, j.future, o)

    def _run(self, jobs: list[_Job], sp: SamplingParams) -> list[list[dict]]:
        """One engine call for ``jobs`` (each ``n`` choices); per job, per choice: ids, logprobs,
        versions, finish_reason."""
        self.engine_calls += 1
        self.engine_rows += sum(j.n for j in jobs)
        prompts = [(j, c) for j in jobs for c in range(j.n)]
        if self.engine.capabilities.keyed:
            reqs = [Request(call_key(j.episode.uid, j.call, c), tuple(j.prompt.ids), 0) for j, c in prompts]
            batch = self.engine.generate_requests(reqs, sp)
        else:
            batch = self.engine.generate([list(j.prompt.ids) for j, _ in prompts], sp, 1)
        out: list[list[dict]] = [[] for _ in jobs]
        index = {id(j): k for k, j in enumerate(jobs)}
        for row, (j, _) in enumerate(prompts):
            out[index[id(j)]].append(self._choice(batch, row, sp))
        return out

    def _choice(self, batch, row: int, sp: SamplingParams) -> dict:
        """Row ``row`` of a generated batch as a call's choice: ids, logprobs, versions, finish_reason."""
        m = batch["action_mask"][row]
        ids = batch["tokens"][row][m].tolist()
        tv = batch["token_version"][row][m].tolist() if "token_version" in batch.keys() else \
            [int(self.engine.policy_version)] * len(ids)
        return {"ids": ids, "logprobs": batch["rollout_logprobs"][row][m].tolist(), "versions": tv,
                "finish_reason": "stop" if ids and ids[-1] in set(sp.stops) else "length"}

    def _submit(self, j: _Job) -> None:
        """A call of an episode opened with ``submit``: its ``n`` requests (keyed like :meth:`_run`'s, within
        the call's ``max_new_tokens``) to the episode's queue; answered when their rows come back."""
        self.engine_calls += 1
        self.engine_rows += j.n
        reqs = [Request(call_key(j.episode.uid, j.call, c), tuple(j.prompt.ids), 0,
                        max_new_tokens=j.sampling.max_new_tokens) for c in range(j.n)]
        with self._lock:
            self._waiting.add(j)

        def done(batch) -> None:
            with self._lock:
                self._waiting.discard(j)
            try:
                out = [self._choice(batch, row, j.sampling) for row in range(j.n)]
            except BaseException as e:  # noqa: BLE001 - the waiting call gets the error
                j.loop.call_soon_threadsafe(_fail, j.future, e)
                return
            j.loop.call_soon_threadsafe(_resolve, j.future, out)

        try:
            j.episode.submit(reqs, done)
        except BaseException as e:  # noqa: BLE001 - the waiting call gets the error
            j.loop.call_soon_threadsafe(_fail, j.future, e)


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
