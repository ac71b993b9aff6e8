"""The gateway's other protocols — OpenAI's Responses API, Anthropic's Messages API, streamed chat completions —
driven by the official ``openai`` and ``anthropic`` clients over HTTP, against a real engine, BPE tokenizer and
ChatML template: the same row rule as chat completions (a call that extends a chain reuses its sampled ids),
streaming never changing what is sampled, errors in each protocol's own shape."""

from __future__ import annotations

import json
import socket
import time

import httpx
from anthropic import Anthropic

from hyperrl.models.tiny import tiny_qwen3
from hyperrl.tokenizer import encode_prompt
from tests.agents.test_gateway import CALL, CHARS, END, MODEL, TOK, TOOLS, _client, _gateway

R_TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
            "parameters": TOOLS[0]["function"]["parameters"]}]
A_TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic.",
            "input_schema": TOOLS[0]["function"]["parameters"]}]
CALLED = TOK.encode(CALL) + [END]


def _anthropic(ep, key=None) -> Anthropic:
    return Anthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=key or ep.api_key, max_retries=0)


def _one_row_of_two_turns(ep, system: str | None = None) -> None:
    """The episode is one row: the first prompt as the template renders it, the call as sampled, the
    template's tokens to the next generation prompt, the answer "56" as sampled (one id per character)."""
    (row,) = ep.record.rows()
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "What is 7 * 8?"}]
    first = encode_prompt(TOK, msgs, tools=TOOLS)
    obs = TOK.encode("\n<|im_start|>user\n<tool_response>\n56\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert row.tokens == first + CALLED + obs + CHARS + [END]
    assert row.action == [False] * len(first) + [True] * len(CALLED) + [False] * len(obs) + [True] * 3
    assert ep.record.rewrites == 0 and [c["extends"] for c in ep.record.log] == [False, True]


def test_responses_api_tool_loop_with_the_openai_client():
    """``client.responses.create`` in a tool loop: the hermes call comes back as a ``function_call`` item; the
    agent sends the items back with a ``function_call_output``; one row, the sampled ids never re-tokenised."""
    with _gateway() as gw:
        ep = gw.open(3)
        client = _client(ep)
        items = [{"role": "user", "content": "What is 7 * 8?"}]
        r = client.responses.create(model=MODEL, input=items, tools=R_TOOLS, instructions="Use the calculator.")
        (call,) = r.output
        assert r.status == "completed" and call.type == "function_call" and call.name == "calculator"
        assert json.loads(call.arguments) == {"expression": "7 * 8"} and r.usage.output_tokens == len(CALLED)
        items += [call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                      "output": "56"}]
        r2 = client.responses.create(model=MODEL, input=items, tools=R_TOOLS, instructions="Use the calculator.")
        assert r2.output_text == "56" and r2.output[0].type == "message"
        gw.finish(ep)
    _one_row_of_two_turns(ep, system="Use the calculator.")


def test_responses_previous_response_id_continues_the_chain_and_store_false_keeps_nothing():
    with _gateway() as gw:
        ep = gw.open(4)
        client = _client(ep)
        r = client.responses.create(model=MODEL, input="What is 7 * 8?", tools=R_TOOLS)
        out = {"type": "function_call_output", "call_id": r.output[0].call_id, "output": "56"}
        r2 = client.responses.create(model=MODEL, previous_response_id=r.id, input=[out], tools=R_TOOLS)
        assert r2.output_text == "56"
        gw.finish(ep)
    _one_row_of_two_turns(ep)
    with _gateway() as gw:
        ep = gw.open(5)
        client = _client(ep)
        r = client.responses.create(model=MODEL, input="What is 7 * 8?", tools=R_TOOLS, store=False)
        out = httpx.post(f"{ep.base_url}/responses", headers={"Authorization": f"Bearer {ep.api_key}"},
                         json={"model": MODEL, "previous_response_id": r.id, "input": "again"}, timeout=30)
        gw.finish(ep)
    assert out.status_code == 404 and out.json()["error"]["param"] == "previous_response_id"


def test_streaming_never_changes_what_is_sampled():
    """A random policy, keyed sampling: the same episode uid samples the same ids whether its calls stream or
    not, on every protocol; the streamed events add up to the non-streamed answer."""
    model = tiny_qwen3(len(TOK), seed=5, pad_id=TOK.pad_token_id, bos_id=None, eos_id=END)
    msgs = [{"role": "user", "content": "Tom has 3 apples"}]
    with _gateway(model, max_new_tokens=12) as gw:
        ids = {}
        for stream in (False, True):
            ep = gw.open(11)
            client = _client(ep)
            if stream:
                chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                             stream_options={"include_usage": True}))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert chunks[-1].usage.completion_tokens == len(ep.record.log[0]["choices"][0]["ids"])
                assert chunks[-2].choices[0].finish_reason in ("stop", "length")
            else:
                text = client.chat.completions.create(model=MODEL, messages=msgs).choices[0].message.content
            ids[("chat", stream)] = (ep.record.log[0]["choices"][0]["ids"], text)
            gw.finish(ep)
        for stream in (False, True):
            ep = gw.open(12)
            client = _client(ep)
            if stream:
                with client.responses.stream(model=MODEL, input=msgs) as s:
                    events = list(s)
                kinds = [e.type for e in events]
                text = events[-1].response.output_text  # completed, or incomplete (the SDK's final needs completed)
                assert kinds[:2] == ["response.created", "response.in_progress"]
                assert kinds[-1] in ("response.completed", "response.incomplete")
                assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
            else:
                text = client.responses.create(model=MODEL, input=msgs).output_text
            ids[("responses", stream)] = (ep.record.log[0]["choices"][0]["ids"], text)
            gw.finish(ep)
        for stream in (False, True):
            ep = gw.open(13)
            client = _anthropic(ep)
            if stream:
                with client.messages.stream(model=MODEL, max_tokens=12, messages=msgs) as s:
                    kinds = [e.type for e in s]
                    text = "".join(b.text for b in s.get_final_message().content if b.type == "text")
                assert kinds[0] == "message_start" and "content_block_delta" in kinds
            else:
                m = client.messages.create(model=MODEL, max_tokens=12, messages=msgs)
                text = "".join(b.text for b in m.content if b.type == "text")
            ids[("messages", stream)] = (ep.record.log[0]["choices"][0]["ids"], text)
            gw.finish(ep)
    for proto in ("chat", "responses", "messages"):
        assert ids[(proto, False)] == ids[(proto, True)], proto
    assert ids[("chat", False)][0] != ids[("responses", False)][0]  # another uid: another sample


def test_streamed_tool_calls_in_chat_and_responses():
    with _gateway() as gw:
        ep = gw.open(6)
        chunks = list(_client(ep).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 7 * 8?"}], tools=TOOLS, stream=True))
        calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "calculator" and calls[0].id
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"expression": "7 * 8"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        ep2 = gw.open(6)
        with _client(ep2).responses.stream(model=MODEL, input="What is 7 * 8?", tools=R_TOOLS) as s:
            kinds = [e.type for e in s]
            final = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds and final.output[0].type == "function_call"
        assert json.loads(final.output[0].arguments) == {"expression": "7 * 8"}
        gw.finish(ep)
        gw.finish(ep2)


def test_messages_api_tool_loop_with_the_anthropic_client():
    """``client.messages.create`` in a tool loop (``tool_use`` → ``tool_result``), then the same loop
    streamed; ``count_tokens`` is the rendered prompt's length."""
    with _gateway() as gw:
        for stream in (False, True):
            ep = gw.open(20 + stream)
            client = _anthropic(ep)
            msgs = [{"role": "user", "content": "What is 7 * 8?"}]

            def ask(messages, client=client, stream=stream):
                if not stream:
                    return client.messages.create(model=MODEL, max_tokens=40, messages=messages, tools=A_TOOLS)
                with client.messages.stream(model=MODEL, max_tokens=40, messages=messages, tools=A_TOOLS) as s:
                    return s.get_final_message()

            m = ask(msgs)
            (use,) = m.content
            assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.input == {"expression": "7 * 8"}
            msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "56"}]}]
            m2 = ask(msgs)
            assert m2.content[0].text == "56" and m2.stop_reason == "end_turn" and m2.usage.output_tokens == 3
            n = client.messages.count_tokens(model=MODEL, messages=msgs[:1], tools=A_TOOLS).input_tokens
            assert n == len(encode_prompt(TOK, msgs[:1], tools=TOOLS))
            gw.finish(ep)
            _one_row_of_two_turns(ep)


def test_stop_sequences_and_max_tokens_in_the_messages_api():
    with _gateway() as gw:
        ep = gw.open(30)
        client = _anthropic(ep)
        m = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "What?"}],
                                   tools=A_TOOLS)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
        ep2 = gw.open(31)
        r = _client(ep2).responses.create(model=MODEL, input="What?", tools=R_TOOLS, max_output_tokens=2)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        gw.finish(ep)
        gw.finish(ep2)


def test_bad_requests_on_each_protocol_name_the_field():
    with _gateway() as gw:
        ep = gw.open(40)
        auth = {"Authorization": f"Bearer {ep.api_key}"}

        def post(path, body, headers=auth):
            return httpx.post(f"{ep.base_url}/{path}", json={"model": MODEL, **body}, headers=headers, timeout=30)

        for body, param in [({"input": "x", "frobnicate": 1}, "frobnicate"),
                            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                             "input[0].content[0].type"),
                            ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                            ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
                            ({"input": []}, "input"), ({"input": "x", "tool_choice": "maybe"}, "tool_choice")]:
            out = post("responses", body)
            assert out.status_code == 400 and out.json()["error"]["param"] == param, (body, out.json())
        a = {"x-api-key": ep.api_key}
        for body, needle in [({"messages": [{"role": "user", "content": "x"}]}, "max_tokens: required"),
                             ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking":
                               {"type": "enabled", "budget_tokens": 100}}, "thinking:"),
                             ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                               "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
                             ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "wat": 1}, "wat:")]:
            out = post("messages", body, headers=a)
            err = out.json()
            assert out.status_code == 400 and err["type"] == "error", err
            assert err["error"]["type"] == "invalid_request_error" and needle in err["error"]["message"], err
        wrong = post("messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
                     headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        other = post("messages", {"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
                     headers=a)
        assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"
        for body, param in [({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
                            ({"messages": [{"role": "user", "content": "x"}], "stream_options": {}}, "stream_options")]:
            out = post("chat/completions", body)
            assert out.status_code == 400 and out.json()["error"]["param"] == param
        assert post("completions", {"prompt": "x", "stream": True}).json()["error"]["param"] == "stream"
        gw.finish(ep)
        assert not ep.record.log  # nothing refused was sampled
        # each refusal of the episode's requests counted (agent_refused_requests); the wrong key is not the episode's
        assert len(ep.refused) == 7 + 4 + 1 + 2 + 1, ep.refused
        assert ep.refused[0].startswith("POST /episodes/") and "400" in ep.refused[0] and "frobnicate" in ep.refused[0]


def test_a_stream_the_client_leaves_is_recorded_whole_and_marked():
    """The client sends a streamed call and hangs up before reading: the call was sampled in full before the
    first byte, so its row is kept whole; the record entry is marked ``abandoned`` and the episode counts it."""
    with _gateway(batch_wait_s=0.3) as gw:  # the call waits 0.3 s for company: the client is gone by then
        ep = gw.open(50)
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "What is 7 * 8?"}],
                           "tools": TOOLS, "stream": True}).encode()
        path = ep.base_url.split("127.0.0.1:", 1)[1].split("/", 1)[1]
        with socket.create_connection(("127.0.0.1", gw.port)) as s:
            s.sendall(f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ep.api_key}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 20
        while not ep.abandoned_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        gw.finish(ep)
    assert ep.abandoned_streams == 1 and ep.record.log[0]["abandoned"]
    assert ep.record.log[0]["choices"][0]["ids"] == CALLED and ep.record.rows()[0].action.count(True) == len(CALLED)


def test_a_qwen3_coder_xml_call_comes_back_as_a_tool_call_on_every_protocol():
    """The model writes Qwen3-Coder's XML call (raw-text values); chat, Responses and Messages clients all get a
    structured call with typed arguments."""
    from hyperrl.envs.tools import TOOL_FORMATS
    from tests.agents.scripted import ScriptedLM, hermes_script

    xml = TOOL_FORMATS.build("qwen3_coder")().render("calculator", {"expression": "7 * 8", "exact": True})
    with _gateway(ScriptedLM(len(TOK), hermes_script(TOK, xml, CHARS)), tool_format="qwen3_coder",
                  max_new_tokens=120) as gw:
        eps = [gw.open(60 + i) for i in range(3)]
        q = "What is 7 * 8?"
        chat = _client(eps[0]).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                                        tools=TOOLS).choices[0].message.tool_calls[0].function
        resp = _client(eps[1]).responses.create(model=MODEL, input=q, tools=R_TOOLS).output[0]
        msg = _anthropic(eps[2]).messages.create(model=MODEL, max_tokens=120, tools=A_TOOLS,
                                                 messages=[{"role": "user", "content": q}]).content[0]
        for e in eps:
            gw.finish(e)
    want = {"expression": "7 * 8", "exact": True}
    assert json.loads(chat.arguments) == json.loads(resp.arguments) == msg.input == want
    assert chat.name == resp.name == msg.name == "calculator"


def test_what_claude_code_sends_is_served():
    """Claude Code 2.1.328's request shape (seen by hand): cached system blocks, a system turn among the
    messages, adaptive thinking, output_config, context_management, metadata — served, not refused."""
    with _gateway() as gw:
        ep = gw.open(80)
        body = {"model": MODEL, "max_tokens": 40, "stream": True, "metadata": {"user_id": "u"},
                "system": [{"type": "text", "text": "You are Claude Code."},
                           {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 7 * 8?"}]},
                             {"role": "system", "content": [{"type": "text", "text": "reminder"}]}],
                "tools": A_TOOLS, "thinking": {"type": "adaptive", "display": "omitted"},
                "output_config": {"effort": "high"}, "context_management": {"edits": []}}
        out = httpx.post(f"{ep.base_url}/messages", json=body, headers={"x-api-key": ep.api_key}, timeout=30)
        gw.finish(ep)
    assert out.status_code == 200 and "event: message_stop" in out.text
    prompt = TOK.decode(ep.record.log[0]["prompt_ids"])
    assert "You are Claude Code.Be brief." in prompt and "<|im_start|>system\nreminder" in prompt
