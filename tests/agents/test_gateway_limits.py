"""The gateway under big or hostile requests (issue 55, item 3): a body bounded by the context before it is parsed
(413), bodies that are not UTF-8 or nest past the parser refused by name (400, not 500), tool schemas checked,
and a render cache that keeps only what was served, bounded by bytes."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.agents.limits import RenderCache, body_bound, parse_body, schema_problem
from tests.agents.test_gateway import MODEL, TOK, _gateway


def _post(ep, path: str, content: bytes, key: str | None = None) -> httpx.Response:
    return httpx.post(f"{ep.base_url}/{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key or ep.api_key}", "Content-Type": "application/json"})


def test_a_body_larger_than_the_context_can_hold_is_refused_before_it_is_read():
    with _gateway(max_model_len=512) as gw:
        bound = gw.max_body
        longest = max(len(t.encode()) for t in TOK.get_vocab())
        assert bound == 6 * longest * 512 + (1 << 20) == body_bound(TOK, 512)
        ep = gw.open(0)
        big = b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}]}' % (MODEL.encode(),
                                                                                    b"x" * (8 << 20))
        out = _post(ep, "chat/completions", big)
        assert out.status_code == 413, out.text
        err = out.json()["error"]
        assert err["param"] == "body" and err["code"] == "request_too_large" and str(bound) in err["message"]
        assert len(ep.refused) == 1 and "413" in ep.refused[0]
        ok = _post(ep, "chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
                   % MODEL.encode())
        assert ok.status_code == 200, ok.text  # the episode goes on
        gw.finish(ep)


def test_bodies_that_are_not_utf8_or_nest_too_deep_are_400s_naming_why():
    with _gateway() as gw:
        ep = gw.open(0)
        for content, words in [(b'{"model": "\xff\xfe"}', "not UTF-8 (byte 11"),
                               (b"[" * 100_000 + b"]" * 100_000, "nested deeper than the parser allows"),
                               (b'{"model": ', "not JSON (Expecting value at char 10)"),
                               (b"[1, 2]", "must be a JSON object")]:
            for path in ("chat/completions", "responses", "messages"):
                out = _post(ep, path, content)
                assert out.status_code == 400, (path, out.text)
                assert words in out.text, (path, out.text)
        assert not ep.record.log and len(ep.refused) == 12
        gw.finish(ep)


def test_tool_schemas_are_checked_on_every_protocol():
    bad = {"type": "object", "properties": {"x": {"type": "strin"}}}
    with _gateway() as gw:
        ep = gw.open(0)
        auth = {"Authorization": f"Bearer {ep.api_key}"}
        for path, body, param in [
                ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}]},
                 "tools[0].function.parameters"),
                ("responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": bad}]},
                 "tools[0].parameters"),
                ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"name": "f", "input_schema": bad}]}, "tools[0].input_schema")]:
            out = httpx.post(f"{ep.base_url}/{path}", json={"model": MODEL, **body}, headers=auth, timeout=30)
            assert out.status_code == 400 and param in out.text and "not a valid JSON Schema" in out.text, out.text
        gw.finish(ep)


def test_the_render_cache_keeps_only_served_prompts_within_its_bytes():
    with _gateway(max_model_len=64) as gw:
        ep = gw.open(0)
        long = {"model": MODEL, "messages": [{"role": "user", "content": "What is 7 * 8? " * 40}]}
        out = httpx.post(f"{ep.base_url}/chat/completions", json=long, timeout=30,
                         headers={"Authorization": f"Bearer {ep.api_key}"})
        assert out.status_code == 400 and "no room" in out.text
        assert gw._renders.size == 0  # refused: not kept
        short = {"model": MODEL, "messages": [{"role": "user", "content": "What is 7 * 8?"}]}
        out = httpx.post(f"{ep.base_url}/chat/completions", json=short, timeout=30,
                         headers={"Authorization": f"Bearer {ep.api_key}"})
        assert out.status_code == 200 and gw._renders.size > 0
        gw.finish(ep)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=30), st.integers(1, 40)), max_size=40), st.integers(50, 2000))
def test_the_render_cache_never_holds_more_than_its_bytes(items, bound):
    cache = RenderCache(bound)
    for text, n in items:
        cache.keep([{"role": "user", "content": text}], None, list(range(n)))
        assert cache.size <= bound
        assert cache.size == sum(len(k) + 8 * len(v) for k, v in cache._items.items())


def test_parse_body_and_schema_problem_name_the_reason():
    assert parse_body(b'{"a": 1}') == {"a": 1}
    assert schema_problem({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    assert "must describe an object" in schema_problem({"type": "array"})
    assert "JSON Schema object, not list" in schema_problem([])
