"""The gateway's own cost per call, side by side in one run: the engine called directly vs the same
call through the gateway with the official ``openai`` client (and with a bare ``httpx`` POST, which
leaves out the SDK's own request building and response parsing).

One call at a time (the latency an agent sees), on the tiny model the calculator task uses (hidden
128 × 2 layers, the character tokenizer and its chat template); each call opens an episode and sends
a one-message chat (the gateway's route, authorise, render, tokenise, sample, record and respond
path; the openai client is built per episode over one shared connection pool, as the agent runner
does). Every protocol, streamed and not (issue 51): chat completions, the Responses API (``openai`` client) and
the Messages API (``anthropic`` client). Appends the table to RESULTS.md. Target (issues 29, 51): ≤ 5 ms per
call.

    python benchmarks/gateway.py --calls 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402


def main():
    import anthropic
    import httpx
    import openai
    import torch

    from hyperrl.agents import Gateway
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams, TransformersEngine
    from hyperrl.rollout.requests import Request
    from hyperrl.tokenizer import char_tokenizer, encode_prompt

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = char_tokenizer()
    engine = TransformersEngine(tiny_qwen3(len(tok), hidden=128, intermediate=256))
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, eos_id=tok.eos_token_id, seed=1)
    messages = [{"role": "user", "content": "347*28="}]
    ids = tuple(encode_prompt(tok, messages))
    body = {"model": "hyperrl-policy", "messages": messages}
    per = {"engine directly": [], "gateway, openai client": [], "gateway, bare httpx POST": []}
    with Gateway(engine, tok, sp, tool_format="qmark") as gw:
        http = openai.DefaultHttpxClient()  # one connection pool, as an agent keeps its client
        raw = httpx.Client()

        def via_client(i):  # a fresh episode each call: the call's own cost, not a growing episode's
            ep = gw.open(i)
            openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0,
                          http_client=http).chat.completions.create(**body)
            gw.finish(ep)

        def via_httpx(i):
            ep = gw.open(i)
            raw.post(f"{ep.base_url}/chat/completions", json=body,
                     headers={"Authorization": f"Bearer {ep.api_key}"}).json()
            gw.finish(ep)

        def episode(i, fn):
            ep = gw.open(i)
            fn(ep)
            gw.finish(ep)

        def oa(ep):
            return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0, http_client=http)

        def an(ep):
            return anthropic.Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0,
                                       http_client=http_an)

        def bare_stream(path, payload, headers):  # the gateway's own stream, read to its end without an SDK
            def call(ep):
                with raw.stream("POST", f"{ep.base_url}/{path}", json=payload,
                                headers={k: v.format(key=ep.api_key) for k, v in headers.items()}) as r:
                    return [json.loads(line[6:]) for line in r.iter_lines()
                            if line.startswith("data: ") and line != "data: [DONE]"]
            return lambda i: episode(i, call)

        bearer = {"Authorization": "Bearer {key}"}
        http_an = anthropic.DefaultHttpxClient()
        calls = {"engine directly": lambda i: engine.generate_requests([Request(i, ids)], sp),
                 "gateway, openai client": via_client, "gateway, bare httpx POST": via_httpx,
                 "chat, streamed": lambda i: episode(i, lambda ep: list(oa(ep).chat.completions.create(
                     **body, stream=True))),
                 "responses": lambda i: episode(i, lambda ep: oa(ep).responses.create(model=body["model"],
                                                                                     input=messages)),
                 "responses, streamed": lambda i: episode(i, lambda ep: list(oa(ep).responses.create(
                     model=body["model"], input=messages, stream=True))),
                 "messages (anthropic client)": lambda i: episode(i, lambda ep: an(ep).messages.create(
                     model=body["model"], max_tokens=args.max_new_tokens, messages=messages)),
                 "messages, streamed": lambda i: episode(i, lambda ep: list(an(ep).messages.create(
                     model=body["model"], max_tokens=args.max_new_tokens, messages=messages, stream=True))),
                 "chat, streamed, bare httpx": bare_stream("chat/completions", {**body, "stream": True}, bearer),
                 "responses, streamed, bare httpx": bare_stream(
                     "responses", {"model": body["model"], "input": messages, "stream": True}, bearer),
                 "messages, streamed, bare httpx": bare_stream(
                     "messages", {"model": body["model"], "max_tokens": args.max_new_tokens, "messages": messages,
                                  "stream": True}, {"x-api-key": "{key}"})}
        per.update({k: [] for k in calls if k not in per})
        for f in calls.values():  # warm up every path
            for i in range(10):
                f(i)
        for _ in range(args.repeats):  # alternate the paths: the machine's noise falls on all of them
            for name, f in calls.items():
                t0 = time.perf_counter()
                for i in range(args.calls):
                    f(i)
                per[name].append((time.perf_counter() - t0) / args.calls * 1e3)
    base = statistics.median(per["engine directly"])
    rows = [[name, round(statistics.median(v), 3), round(statistics.median(v) - base, 3),
             round(statistics.median(v) / base, 2)] for name, v in per.items()]
    body_md = table(["path", "ms per call (median of repeats)", "overhead ms", "ratio"], rows)
    over = statistics.median(per["gateway, openai client"]) - base
    worst = max((statistics.median(v) - base, k) for k, v in per.items() if "bare" in k)
    body_md += (f"\n\nReading: one call of {args.max_new_tokens} new tokens at a time; the gateway with the official "
                f"client adds {over:.2f} ms per call over the engine itself (target ≤ 5 ms); read without an SDK, the "
                f"gateway's own cost is at most {worst[0]:.2f} ms ({worst[1]}) — the rest of an SDK row is the "
                "client's own request building and event parsing.")
    append_results("the gateway's overhead per call (benchmarks/gateway.py)", body_md)


if __name__ == "__main__":
    main()
