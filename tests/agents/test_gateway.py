"""The OpenAI-compatible gateway: real engine, real BPE tokenizer and ChatML template, the official
``openai`` client over HTTP — every call's exact ids recorded, never re-tokenised."""

from __future__ import annotations

import json

import httpx
import torch
from openai import OpenAI

from hyperrl.agents import Gateway
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rollout import SamplingParams, TransformersEngine
from hyperrl.tokenizer import encode_prompt
from tests.agents.scripted import ScriptedLM, hermes_script
from tests.hf_fixtures import bpe_tokenizer

TOK = bpe_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'
CHARS = TOK.convert_tokens_to_ids(["5", "6"])  # "56" one id per character; the BPE merges it into one
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
MODEL = "hyperrl-policy"


def _gateway(model=None, **kw) -> Gateway:
    model = model if model is not None else ScriptedLM(len(TOK), hermes_script(TOK, CALL, CHARS))
    sp = SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 40), eos_id=END, seed=1)
    return Gateway(TransformersEngine(model), TOK, sp, **kw)


def _client(ep, key=None) -> OpenAI:
    return OpenAI(base_url=ep.base_url, api_key=key or ep.api_key, max_retries=0)


def test_a_tool_loop_through_the_openai_client_records_the_sampled_ids():
    """The official client in a multi-turn tool loop: the model's hermes call comes back as OpenAI
    ``tool_calls``; the agent runs it and sends a ``tool`` message; the episode is one row whose ids
    are the first prompt as the template renders it, the call exactly as sampled, the template's own
    tokens up to the next generation prompt (mask 0) and the answer exactly as sampled — one id per
    character, though re-tokenising its text gives a different (merged) id."""
    assert TOK.encode("56") != CHARS  # the non-bijective case: text → ids is not the inverse of ids → text
    with _gateway() as gw:
        ep = gw.open(3)
        client = _client(ep)
        messages = [{"role": "user", "content": "What is 7 * 8?"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, logprobs=True)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
        call = msg.tool_calls[0]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "7 * 8"}
        assert r.choices[0].logprobs.content[0].logprob > -1e-6  # the scripted model's choice: probability ≈ 1
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "56"}]
        r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert r2.choices[0].message.content == "56" and r2.choices[0].finish_reason == "stop"
        assert r2.usage.completion_tokens == 3
        gw.finish(ep)
    (row,) = ep.record.rows()
    first = encode_prompt(TOK, messages[:1], tools=TOOLS)
    called = TOK.encode(CALL) + [END]
    obs = TOK.encode("\n<|im_start|>user\n<tool_response>\n56\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert row.tokens == first + called + obs + CHARS + [END]
    assert row.action == [False] * len(first) + [True] * len(called) + [False] * len(obs) + [True] * 3
    assert row.turns == 2 and row.tool_calls == 1 and ep.record.rewrites == 0
    # the assistant → tool boundary: the newline after the sampled <|im_end|> is kept, <|im_end|> not doubled
    k = len(first) + len(called)
    assert row.tokens[k - 1] == END and TOK.decode(row.tokens[k:k + 2]) == "\n<|im_start|>"
    assert all(v == 0 for v, a in zip(row.versions, row.action) if a)
    # every call as it happened: its prompt ids, and the sampled ids / log-probs / versions / finish reason
    first_call, second_call = ep.record.log
    assert first_call["prompt_ids"] == first and not first_call["extends"]
    assert first_call["choices"][0]["ids"] == called and first_call["choices"][0]["finish_reason"] == "stop"
    assert second_call["extends"] and second_call["prompt_ids"] == first + called + obs
    assert second_call["choices"][0]["ids"] == CHARS + [END] and second_call["choices"][0]["versions"] == [0] * 3
    assert len(second_call["choices"][0]["logprobs"]) == 3
    assert all(v == -1 for v, a in zip(row.versions, row.action) if not a)


def test_a_rewritten_history_starts_a_new_row_of_context():
    """An agent that drops its history (or edits the reply) cannot be extended: its call starts a new
    chain whose prompt is rendered whole and is context only — what was sampled is trained once."""
    with _gateway() as gw:
        ep = gw.open(4)
        client = _client(ep)
        first = [{"role": "user", "content": "What is 7 * 8?"}]
        r = client.chat.completions.create(model=MODEL, messages=first, tools=TOOLS)
        edited = {"role": "assistant", "content": "I will compute it."}  # not what the model said
        client.chat.completions.create(model=MODEL, messages=[*first, edited, {"role": "user", "content": "go"}],
                                       tools=TOOLS)
        gw.finish(ep)
    assert r.choices[0].message.tool_calls
    a, b = ep.record.rows()
    assert ep.record.rewrites == 1
    prompt_b = encode_prompt(TOK, [*first, edited, {"role": "user", "content": "go"}], tools=TOOLS)
    assert b.tokens[:len(prompt_b)] == prompt_b and not any(b.action[:len(prompt_b)])
    assert sum(a.action) == sum(b.action) == len(TOK.encode(CALL)) + 1


def test_n_choices_fork_and_each_sampled_token_is_trained_once():
    """``n = 3``: the first choice continues the chain, the others are rows of their own whose shared
    prefix is context; a follow-up extending choice 2 continues that row."""
    model = tiny_qwen3(len(TOK), seed=0, pad_id=TOK.pad_token_id, bos_id=None, eos_id=END)
    with _gateway(model, max_new_tokens=6) as gw:
        ep = gw.open(5)
        client = _client(ep)
        first = [{"role": "user", "content": "Hi"}]
        r = client.chat.completions.create(model=MODEL, messages=first)
        r2 = client.chat.completions.create(model=MODEL, messages=[*first, r.choices[0].message.model_dump(),
                                                                   {"role": "user", "content": "more"}], n=3)
        pick = r2.choices[2].message
        client.chat.completions.create(model=MODEL, messages=[*first, r.choices[0].message.model_dump(),
                                                              {"role": "user", "content": "more"}, pick.model_dump(),
                                                              {"role": "user", "content": "and?"}])
        gw.finish(ep)
    rows = ep.record.rows()
    assert len(rows) == 3 and ep.record.rewrites == 0
    assert [r.turns for r in rows] == [2, 2, 3]  # chain 0: turns 1 + choice 0; choice 1; choice 2 + one more
    assert sum(rows[0].action) == 12 and sum(rows[1].action) == 6 and sum(rows[2].action) == 12
    assert rows[1].tokens[:len(rows[0].tokens) - 6] == rows[0].tokens[:-6]  # the shared prefix …
    assert not any(rows[1].action[:len(rows[0].tokens) - 6])  # … is context in the fork


def test_completions_token_in_and_text_extension():
    """``/v1/completions``: token ids in (token-in-token-out for agents that keep ids), and a text
    prompt extending the last prompt + completion reuses the sampled ids (the rest tokenised once)."""
    model = tiny_qwen3(len(TOK), seed=1, pad_id=TOK.pad_token_id, bos_id=None, eos_id=END)
    with _gateway(model, max_new_tokens=5) as gw:
        ep = gw.open(6)
        client = _client(ep)
        ids = TOK.encode("The sum of 3 and 4")
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5)
        gw_row = ep.record.chains[0]
        sampled = gw_row.tokens[len(ids):]
        r2 = client.completions.create(model=MODEL, prompt=gw_row.tokens + TOK.encode(" is"), max_tokens=3)
        assert r2.usage.prompt_tokens == len(ids) + 5 + len(TOK.encode(" is"))
        text = "Tom has"
        r3 = client.completions.create(model=MODEL, prompt=text, max_tokens=4)
        r4 = client.completions.create(model=MODEL, prompt=text + r3.choices[0].text + " apples", max_tokens=2)
        gw.finish(ep)
    a, b = ep.record.rows()
    assert a.tokens[:len(ids) + 5] == ids + sampled and sum(a.action) == 5 + 3
    assert b.kind == "completion" and sum(b.action) == 4 + 2 and ep.record.rewrites == 1  # the text chain is new
    assert r.choices[0].text and r4.usage.prompt_tokens == len(b.tokens) - 2


def test_bad_requests_get_openai_errors_never_a_crash():
    """Wrong key 401, unknown or finished episode 404, another model 404, malformed fields 400 naming
    them, a prompt over the context 400 with the reason, streaming refused; a model's malformed tool
    call is its text (the agent sees it) and is counted."""
    bad_call = '<tool_call>{"name": "calculator", "arguments": </tool_call>'
    with _gateway(ScriptedLM(len(TOK), hermes_script(TOK, bad_call, CHARS)), max_model_len=300) as gw:
        ep = gw.open(7)
        client = _client(ep)
        msgs = [{"role": "user", "content": "What is 7 * 8?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == bad_call
        assert ep.malformed_tool_calls == 1
        url = f"{ep.base_url}/chat/completions"
        auth = {"Authorization": f"Bearer {ep.api_key}"}

        def post(body, headers=auth, to=url):
            return httpx.post(to, json=body, headers=headers, timeout=30)

        assert post({"model": MODEL, "messages": msgs}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert post({"model": "gpt-4o", "messages": msgs}).json()["error"]["code"] == "model_not_found"
        for body, param in [({"messages": []}, "messages"), ({"messages": msgs, "n": 0}, "n"),
                            ({"messages": msgs, "temperature": "hot"}, "temperature"),
                            ({"messages": msgs, "stream": "yes"}, "stream"),
                            ({"messages": msgs, "top_logprobs": 3}, "top_logprobs"),
                            ({"messages": msgs, "tools": [{"type": "function"}]}, "tools[0]"),
                            ({"messages": msgs, "tool_choice": "sometimes"}, "tool_choice"),
                            ({"messages": [{"content": "no role"}]}, "messages"),
                            ({"messages": [{"role": "user", "content": "x " * 400}]}, "messages")]:
            out = post({"model": MODEL, **body})
            assert out.status_code == 400 and out.json()["error"]["param"] == param, (body, out.json())
        assert "no room in the context" in post({"model": MODEL, "messages": [
            {"role": "user", "content": "x " * 400}]}).json()["error"]["message"]
        assert post({"model": MODEL, "messages": msgs}, to=url.replace(ep.id, "0" * 32)).status_code == 404
        gw.finish(ep)
        assert post({"model": MODEL, "messages": msgs}).status_code == 404  # finished
        assert gw.host == "127.0.0.1"


def test_batched_calls_are_keyed_by_episode_not_by_batch():
    """Calls from several episodes at once are batched into one engine call, and what each samples
    depends on its episode uid and call index only (keyed sampling): the same episode alone samples
    the same ids."""
    import threading

    model = tiny_qwen3(len(TOK), seed=2, pad_id=TOK.pad_token_id, bos_id=None, eos_id=END)
    msgs = [{"role": "user", "content": "Tom has 3 apples"}]
    with _gateway(model, max_new_tokens=8, batch_wait_s=0.05) as gw:
        eps = [gw.open(100 + i) for i in range(6)]
        threads = [threading.Thread(target=lambda e=e: _client(e).chat.completions.create(model=MODEL, messages=msgs))
                   for e in eps]
        [t.start() for t in threads]
        [t.join() for t in threads]
        alone = gw.open(103)
        _client(alone).chat.completions.create(model=MODEL, messages=msgs)
        for e in [*eps, alone]:
            gw.finish(e)
    rows = [e.record.rows()[0].tokens for e in eps]
    assert alone.record.rows()[0].tokens == rows[3]
    assert len({tuple(r) for r in rows}) > 1  # different episodes sample differently


def test_the_gateway_records_versions_and_the_run_sampling():
    """A training gateway samples at the run's temperature whatever the request asks (counted); the
    per-token versions are the engine's version at the call."""
    model = tiny_qwen3(len(TOK), seed=3, pad_id=TOK.pad_token_id, bos_id=None, eos_id=END)
    with _gateway(model, max_new_tokens=4) as gw:
        gw.engine.load_weights({k: v.clone() for k, v in model.state_dict().items()}, version=7)
        ep = gw.open(1)
        r = _client(ep).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0.0, max_tokens=2)
        gw.finish(ep)
    row = ep.record.rows()[0]
    assert r.usage.completion_tokens == 2 and ep.overridden == 1
    assert [v for v, a in zip(row.versions, row.action) if a] == [7, 7]
    assert torch.tensor([lp for lp, a in zip(row.logprobs, row.action) if a]).le(0).all()


def test_stop_strings_cut_the_text_and_keep_the_ids_that_made_it():
    """``stop``: the text ends before the stop string (OpenAI), the recorded ids end with the token
    that completed it (vLLM's semantics) and nothing after; ``finish_reason`` is ``stop``."""
    with _gateway() as gw:
        ep = gw.open(8)
        client = _client(ep)
        messages = [{"role": "user", "content": "What is 7 * 8?"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        messages += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "56"}]
        r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stop=["6"])
        gw.finish(ep)
    assert r2.choices[0].message.content == "5" and r2.choices[0].finish_reason == "stop"
    (row,) = ep.record.rows()
    assert row.tokens[-2:] == CHARS and row.action[-2:] == [True, True]  # "5", "6": no <|im_end|> sampled after


def test_content_the_template_cannot_take_is_a_400_naming_messages():
    with _gateway() as gw:
        ep = gw.open(9)
        out = httpx.post(f"{ep.base_url}/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                         json={"model": MODEL, "messages": [{"role": "user", "content": [
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, timeout=30)
        gw.finish(ep)
    assert out.status_code == 400 and out.json()["error"]["param"] == "messages"
    assert out.json()["error"]["message"].startswith("messages: a content part must be {'type': 'text'")


def test_two_calls_extending_one_chain_at_once_do_not_mix():
    """Concurrent calls from the same history (an agent's parallel branches): both prompts extend the
    chain; the first recorded continues it, the second becomes a row of its own whose prompt is context
    — never the first's tokens followed by the second's observation."""
    from hyperrl.agents import EpisodeRecord

    rec = EpisodeRecord(TOK)
    first = [{"role": "user", "content": "Hi"}]
    p0 = rec.chat_prompt(first, None)
    reply = {"role": "assistant", "content": "ok"}
    ok = TOK.encode("ok") + [END]
    rec.record(p0, [{"ids": ok, "logprobs": [-0.1] * len(ok), "versions": [0] * len(ok), "finish_reason": "stop",
                     "reply": reply}], kind="chat")
    more = [*first, reply, {"role": "user", "content": "more"}]
    a, b = rec.chat_prompt(more, None), rec.chat_prompt(more, None)
    assert a.chain is b.chain is rec.chains[0]
    x = TOK.encode("x") + [END]
    for p in (a, b):
        rec.record(p, [{"ids": x, "logprobs": [-0.2] * len(x), "versions": [1] * len(x), "finish_reason": "stop",
                        "reply": {"role": "assistant", "content": "x"}}], kind="chat")
    one, two = rec.rows()
    assert one.tokens == a.ids + x and sum(one.action) == len(ok) + len(x)
    assert two.tokens == b.ids + x and sum(two.action) == len(x) and not any(two.action[:len(b.ids)])


def test_a_gateway_bound_beyond_loopback_for_remote_agents():
    """``host`` 0.0.0.0 and ``public_url``: episodes hand out the public URL, the gateway answers on this
    machine's other addresses, the key is still required (and never echoed), and a finished episode's key is
    dead."""
    import socket

    from hyperrl.agents.programs import _check_listen

    with _gateway(host="0.0.0.0", public_url="http://agents.example:9000/") as gw:
        ep = gw.open(70)
        assert ep.base_url == f"http://agents.example:9000/episodes/{ep.id}/v1"
        addrs = {socket.gethostbyname(socket.gethostname()), "127.0.0.1"}
        for addr in addrs:
            url = f"http://{addr}:{gw.port}/episodes/{ep.id}/v1"
            ok = OpenAI(base_url=url, api_key=ep.api_key, max_retries=0).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What is 7 * 8?"}], tools=TOOLS)
            assert ok.choices[0].finish_reason == "tool_calls"
            bad = httpx.post(f"{url}/chat/completions", headers={"Authorization": "Bearer guess"},
                             json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=30)
            assert bad.status_code == 401 and "guess" not in bad.text and ep.api_key not in bad.text
        gw.finish(ep)
        dead = httpx.post(f"http://127.0.0.1:{gw.port}/episodes/{ep.id}/v1/chat/completions", timeout=30,
                          headers={"Authorization": f"Bearer {ep.api_key}"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert dead.status_code == 404
    with _gateway(host="0.0.0.0") as gw:  # no public URL: the machine's host name
        assert gw.open(71).base_url.startswith(f"http://{socket.gethostname()}:{gw.port}/episodes/")
    for bad, key in [({"host": 1}, "host"), ({"port": 70000}, "port"), ({"public_url": "agents:9000"}, "public_url"),
                     ({"hots": "x"}, "gateway")]:
        try:
            _check_listen(bad)
            raise AssertionError(bad)
        except ValueError as e:
            assert f"env.gateway.{key}" in str(e) or (key == "gateway" and "env.gateway=" in str(e)), e
