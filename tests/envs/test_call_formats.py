"""The 2026 tool-call formats: each renders a call and parses it back (property-tested on arguments with quotes,
newlines, nested JSON and unicode); broken markup is an observation the model sees, never a crash; the gateway
turns each into OpenAI tool calls."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.envs.tools import TOOL_FORMATS, resolve_call

NAMES = ["hermes", "hyperrl", "qwen3_coder", "glm45", "deepseek_v31", "kimi_k2"]
XML = ("qwen3_coder", "glm45")  # values written raw: a string that reads as JSON is ambiguous there, as in the format

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
_scalar = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(), st.floats(allow_nan=False,
                                                                                    allow_infinity=False), _text)
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(_text, inner, max_size=3)), max_leaves=8)
_key = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,20}", fullmatch=True)


def _representable(fmt: str, args: dict) -> bool:
    """What a format can carry at all: XML values are raw text, so a string value must not read as JSON, hold
    the closing tag, or begin / end with the newline the format puts around it."""
    if fmt not in XML:
        return True
    close = "</parameter>" if fmt == "qwen3_coder" else "</arg_value>"
    for v in args.values():
        if isinstance(v, str):
            try:
                json.loads(v)
                return False
            except ValueError:
                pass
            if close in v or v != v.strip("\n") or (fmt == "glm45" and "</tool_call>" in v):
                return False
        elif close in json.dumps(v, ensure_ascii=False) or "</tool_call>" in json.dumps(v, ensure_ascii=False):
            return False
    return True


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(NAMES), name=_name, args=st.dictionaries(_key, _json, max_size=4),
       before=st.sampled_from(["", "Let me check.\n", "思考 \"quoted\"\n"]))
def test_every_format_round_trips(fmt, name, args, before):
    f = TOOL_FORMATS.build(fmt)()
    if not _representable(fmt, args):
        return
    text = before + f.render(name, args)
    (payload,) = f.parse(text)
    assert resolve_call(payload, f, [name]) == (name, json.loads(json.dumps(args)))
    assert f.strip(text) == before.strip()


def test_two_calls_in_one_turn_and_the_published_examples():
    qc = TOOL_FORMATS.build("qwen3_coder")()
    text = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
            "</function>\n</tool_call>")
    assert [json.loads(p) for p in qc.parse(text)] == [
        {"name": "get_weather", "arguments": {"city": "San Francisco", "days": 3}}, {"name": "now", "arguments": {}}]
    glm = TOOL_FORMATS.build("glm45")()
    assert json.loads(glm.parse("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
                                "<arg_key>opts</arg_key>\n<arg_value>{\"unit\": \"c\"}</arg_value>\n</tool_call>")[0]) \
        == {"name": "get_weather", "arguments": {"city": "北京", "opts": {"unit": "c"}}}
    ds = TOOL_FORMATS.build("deepseek_v31")()
    two = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜>"
           "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert [json.loads(p)["name"] for p in ds.parse(two)] == ["a", "b"]
    kimi = TOOL_FORMATS.build("kimi_k2")()
    k = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>"
         "{\"q\": \"rl\"}<|tool_call_end|><|tool_call_begin|>functions.open:1<|tool_call_argument_begin|>{}"
         "<|tool_call_end|><|tool_calls_section_end|>")
    assert [json.loads(p) for p in kimi.parse(k)] == [{"name": "search", "arguments": {"q": "rl"}},
                                                       {"name": "open", "arguments": {}}]
    for f in NAMES:
        assert TOOL_FORMATS.build(f)().parse("no call here, just <b>text</b>") == []


def test_broken_markup_is_an_observation_never_a_crash():
    cases = {"qwen3_coder": "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
             "glm45": "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
             "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": <｜tool▁call▁end｜>",
             "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
                        "{bad<|tool_call_end|>"}
    for name, text in cases.items():
        f = TOOL_FORMATS.build(name)()
        (payload,) = f.parse(text)
        out = resolve_call(payload, f, ["f"])
        assert isinstance(out, str) and out.startswith("error: malformed tool call JSON"), (name, out)
