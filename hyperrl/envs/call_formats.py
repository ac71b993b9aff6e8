"""The tool-call formats of 2026's open models, as parsers with renderers (registered in
:data:`hyperrl.envs.tools.TOOL_FORMATS` beside ``hermes``):

* ``qwen3_coder`` — Qwen3-Coder's XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n…
  </function>\\n</tool_call>``; a value is raw text (a string as is, anything else as JSON);
* ``glm45`` — GLM-4.5 / 4.6: ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n…
  </tool_call>``, values as Qwen3-Coder's;
* ``deepseek_v31`` — DeepSeek-V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}
  <｜tool▁call▁end｜>…<｜tool▁calls▁end｜>``;
* ``kimi_k2`` — Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
  <|tool_call_argument_begin|>{JSON}<|tool_call_end|>…<|tool_calls_section_end|>``.

(gpt-oss's harmony format needs its own renderer of the whole conversation — channels, not a call inside the text
— and no tokenizer here carries its template: not registered.)

Each parser returns the calls as the JSON payloads :func:`~hyperrl.envs.tools.resolve_call` reads
(``{"name": …, "arguments": {…}}``); a call whose markup is broken comes back as a payload that does not decode,
which ``resolve_call`` turns into the error text the model sees — an observation, never a crash. The formats'
markers are text to these parsers: a tokenizer must decode them (DeepSeek's and Kimi's markers are added tokens
that are not special in their tokenizers, so decoding keeps them). Written from the formats' published
templates and examples (the same regular grammar vLLM's parsers read), not from their code.
"""

from __future__ import annotations

import json
import re

__all__ = ["raw_value", "render_value", "FORMATS"]


def raw_value(text: str):
    """A Qwen3-Coder / GLM parameter value: JSON when it is JSON other than a bare string (numbers, booleans,
    null, objects, arrays), else the text itself (a string is written raw)."""
    try:
        v = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text
    return text if isinstance(v, str) else v


def render_value(v) -> str:
    """The inverse of :func:`raw_value` for values it can tell apart: a string raw, anything else as JSON."""
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _broken(text: str) -> str:
    return "malformed tool call: " + text[:200]


# ---------------------------------------------------------------- Qwen3-Coder
_QC_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_QC_FN = re.compile(r"^\s*<function=([^>\n]+)>\n?(.*?)</function>\s*$", re.S)
_QC_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _qwen3_coder_parse(text: str) -> list[str]:
    out = []
    for body in _QC_CALL.findall(text):
        m = _QC_FN.match(body)
        if m is None:
            out.append(_broken(body))
            continue
        args = {k.strip(): raw_value(v) for k, v in _QC_PARAM.findall(m.group(2))}
        out.append(json.dumps({"name": m.group(1).strip(), "arguments": args}, ensure_ascii=False))
    return out


def _qwen3_coder_render(name: str, arguments: dict) -> str:
    params = "".join(f"<parameter={k}>\n{render_value(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# ---------------------------------------------------------------- GLM-4.5
_GLM_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm45_parse(text: str) -> list[str]:
    out = []
    for body in _GLM_CALL.findall(text):
        name, _, rest = body.partition("\n")
        if not name.strip() or "<" in name:
            out.append(_broken(body))
            continue
        args = {k.strip(): raw_value(v) for k, v in _GLM_ARG.findall(rest)}
        out.append(json.dumps({"name": name.strip(), "arguments": args}, ensure_ascii=False))
    return out


def _glm45_render(name: str, arguments: dict) -> str:
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{render_value(v)}</arg_value>\n" for k, v in arguments.items())
    return f"<tool_call>{name}\n{args}</tool_call>"


# ---------------------------------------------------------------- DeepSeek-V3.1
_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_DS_SECTION = re.compile(re.escape(_DS_BEGIN) + r".*?(?:" + re.escape(_DS_END) + r"|$)", re.S)


def _deepseek_v31_parse(text: str) -> list[str]:
    return [_json_call(name, args) for section in _DS_SECTION.findall(text) for name, args in _DS_CALL.findall(section)]


def _deepseek_v31_render(name: str, arguments: dict) -> str:
    return (f"{_DS_BEGIN}<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(arguments, ensure_ascii=False)}"
            f"<｜tool▁call▁end｜>{_DS_END}")


# ---------------------------------------------------------------- Kimi-K2
_KIMI_BEGIN, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^:<\s]+)(?::\d+)?\s*"
                        r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)
_KIMI_SECTION = re.compile(re.escape(_KIMI_BEGIN) + r".*?(?:" + re.escape(_KIMI_END) + r"|$)", re.S)


def _kimi_k2_parse(text: str) -> list[str]:
    return [_json_call(name, args) for section in _KIMI_SECTION.findall(text)
            for name, args in _KIMI_CALL.findall(section)]


def _kimi_k2_render(name: str, arguments: dict, index: int = 0) -> str:
    return (f"{_KIMI_BEGIN}<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
            f"{json.dumps(arguments, ensure_ascii=False)}<|tool_call_end|>{_KIMI_END}")


def _json_call(name: str, args: str) -> str:
    try:
        parsed = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        return _broken(args)
    return json.dumps({"name": name.strip(), "arguments": parsed}, ensure_ascii=False)


# name → (parse, strip pattern, render); registered by hyperrl.envs.tools
FORMATS = {
    "qwen3_coder": (_qwen3_coder_parse, _QC_CALL, _qwen3_coder_render),
    "glm45": (_glm45_parse, _GLM_CALL, _glm45_render),
    "deepseek_v31": (_deepseek_v31_parse, _DS_SECTION, _deepseek_v31_render),
    "kimi_k2": (_kimi_k2_parse, _KIMI_SECTION, _kimi_k2_render),
}
