"""Example environments: GSM8K with a calculator tool, a calculator the policy must call and copy
(the tool-use task a tiny model learns), and Search-R1-style retrieval."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Annotated

from pydantic import AfterValidator

from hyperrl.envs.base import EnvCapabilities, StepResult, register_environment
from hyperrl.envs.tools import (
    BM25Index,
    ToolFormatName,
    ToolRunner,
    calculate,
    calculator_tool,
    check_tool_format,
    make_search_tool,
)
from hyperrl.rewards.builtin import digit_match, extract_gsm8k_answer, gsm8k_exact, normalize_number

__all__ = ["GSM8KCalculatorEnv", "CalculatorCopyEnv", "SearchEnv", "ToolChatEnv"]


def _question(sample, runner: ToolRunner):
    """The first prompt: the question text (compact format), or the sample's chat messages (a
    string becomes one user message) for a chat format, whose template lists ``runner``'s tools."""
    if runner.format.chat:
        return [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt)
    q = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    return f"{q}\n"


def _copy_format(name: str) -> str:
    """``compact`` (this environment's own syntax: it needs the question) or a registered format."""
    if name == "compact":
        return name
    try:
        return check_tool_format(name)
    except ValueError as e:
        raise ValueError(f"{e}; or 'compact'") from None


@register_environment("calculator_copy", capabilities=EnvCapabilities(reports_success=True))
class CalculatorCopyEnv:
    """Arithmetic the policy cannot do in its head (task ``products``): it must call the calculator
    and copy the result into its answer. At most ``max_calls`` calls; the first response without a
    call — or the one after the last allowed call — is the answer, and ends the episode.

    ``format="compact"`` (for the tiny character-level model): a response that *begins with* ``?``
    calls the calculator on the question (``sample.extra["expression"]``, else the prompt without
    its ``=``); the observation is ``[09716]`` — the result zero-padded to the answer's width, so a
    digit's place is its position — with action mask 0; the answer is the response as is.
    Any registered tool-call format (``hermes`` through the chat template, ``hyperrl`` tags): the
    policy writes the call with its own expression; the answer is the last number in the final
    response. Reward: :func:`~hyperrl.rewards.builtin.digit_match` of the answer (dense per place; 1
    exactly when it is right) plus ``call_reward`` per call that returned a result (shaping that
    makes the rare first calls pay before copying is learned; 0 turns it off). ``info["success"]``:
    the answer is exact (the held-out success rate), whatever the shaping."""


    def __init__(self, *, format: Annotated[str, AfterValidator(_copy_format)] = "compact", call_reward: float = 0.1,
                 max_calls: int = 1):
        if max_calls < 1:
            raise ValueError(f"env.max_calls={max_calls}: the policy needs at least one call")
        self.call_reward, self.max_calls = call_reward, max_calls
        self.runner = None if format == "compact" else ToolRunner({"calculator": calculator_tool},
                                                                 max_calls_per_turn=1, fmt=format)
        self.tools = self.runner.specs() if self.runner is not None and self.runner.format.chat else None
        self.sample, self.calls = None, 0

    def reset(self, sample):
        self.sample, self.calls = sample, 0
        return sample.prompt if self.runner is None else _question(sample, self.runner)

    def _call(self, action: str):
        """The observation of the call ``action`` makes and whether it returned a result; None when
        ``action`` makes no call."""
        if self.runner is not None:
            results = self.runner.run(action)
            return (self.runner.format.observation(results), any(r.ok for r in results)) if results else None
        if not action.startswith("?"):
            return None
        expr = (self.sample.extra or {}).get("expression") or str(self.sample.prompt).rstrip("=")
        try:
            return f"[{calculate(expr).zfill(len(str(self.sample.answer)))}]", True
        except (ValueError, SyntaxError, ArithmeticError) as e:  # an error is an observation, never a crash
            return f"[error: {type(e).__name__}]", False

    def step(self, action: str) -> StepResult:
        call = self._call(action) if self.calls < self.max_calls else None
        if call is not None:
            self.calls += 1
            obs, ok = call
            return StepResult(obs, self.call_reward * ok, False, {"tool_calls": 1})
        answer, sample = action, self.sample
        if self.runner is not None:  # a free-form final message: its last number against the plain answer
            answer = extract_gsm8k_answer(action) or ""
            sample = dataclasses.replace(sample, answer=normalize_number(str(sample.answer)) or str(sample.answer))
        score = digit_match(answer, sample)
        return StepResult("", score, True, {"success": score == 1.0})


class _ToolTurns:
    """Turns of tool calls run by ``self.runner`` until a response makes none: ``_final(action)`` scores
    that response (and ends the episode); ``_penalty(results)`` is a calling turn's reward."""

    runner: ToolRunner

    def reset(self, sample):
        self.sample = sample
        return _question(sample, self.runner)

    def step(self, action: str) -> StepResult:
        results = self.runner.run(action)
        if not results:
            return self._final(action)
        return StepResult(self.runner.format.observation(results), self._penalty(results), False,
                          {"tool_calls": len(results)})

    def _final(self, action: str) -> StepResult:
        return StepResult("", 0.0, True, {})

    def _penalty(self, results) -> float:
        return 0.0


@register_environment("gsm8k_calculator", capabilities=EnvCapabilities(reports_success=True))
class GSM8KCalculatorEnv(_ToolTurns):
    """The model may call the calculator — ``format="hyperrl"``: ``<tool>{"name": "calculator",
    "arguments": {"expression": ...}}</tool>``, each result back as ``<result>…</result>``;
    ``format="hermes"``: ``<tool_call>{...}</tool_call>`` with the tool listed by the chat
    template and results as ``tool`` messages. The episode ends when the response has no tool
    call; reward = GSM8K exact match of that final response (``#### n`` or the last number), plus
    ``invalid_reward`` per failed tool call; ``info["success"]``: that exact match."""


    def __init__(self, *, invalid_reward: float = 0.0, max_calls_per_turn: int = 2, format: ToolFormatName = "hyperrl"):
        self.runner = ToolRunner({"calculator": calculator_tool}, max_calls_per_turn=max_calls_per_turn, fmt=format)
        self.tools = self.runner.specs() if self.runner.format.chat else None
        self.invalid_reward = invalid_reward
        self.sample = None

    def _final(self, action: str) -> StepResult:
        r = gsm8k_exact(action, self.sample)
        return StepResult("", r, True, {"success": r == 1.0})

    def _penalty(self, results) -> float:
        return self.invalid_reward * sum(not r.ok for r in results)


@register_environment("tool_chat", capabilities=EnvCapabilities(takes_tools=True, scores_final_turn=True))
class ToolChatEnv(_ToolTurns):
    """A chat with the run's tools (``tools:`` — MCP servers' and registered tools): the model calls
    them in its format (``hermes``: through the chat template, which lists their JSON schemas; each
    result comes back as a ``tool`` message), at most ``max_calls_per_turn`` a turn; the first response
    without a call is the final answer and ends the episode. Reward: the configured ``rewards:`` over
    that final response (the environment adds 0); ``tool_calls`` counts the calls. ``tools`` is the
    run's, given by the loop (not a hyperparameter)."""


    def __init__(self, tools: dict | None = None, *, format: ToolFormatName = "hermes", max_calls_per_turn: int = 4):
        if not tools:
            raise ValueError("env tool_chat: no tools; list them under tools: (e.g. tools: [{mcp: [python, -m, "
                             "my_server]}] or [{name: calculator}])")
        self.runner = ToolRunner(dict(tools), max_calls_per_turn=max_calls_per_turn, fmt=format)
        self.tools = self.runner.specs() if self.runner.format.chat else None
        self.sample = None


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class SearchEnv(_ToolTurns):
    """Search-R1 style: ``<tool>{"name": "search", "arguments": {"query": ...}}</tool>`` returns BM25
    passages in ``<result>``; ``<answer>…</answer>`` ends the episode with exact-match reward
    (``info["success"]``)."""


    def __init__(self, index: BM25Index, *, k: int = 2, format: str = "hyperrl"):
        self.runner = ToolRunner({"search": make_search_tool(index, k=k)}, max_calls_per_turn=1, fmt=format)
        self.tools = self.runner.specs() if self.runner.format.chat else None
        self.sample = None

    def step(self, action: str) -> StepResult:
        m = _ANSWER.search(action)
        if m:
            ok = m.group(1).strip().lower() == str(self.sample.answer).strip().lower()
            return StepResult("", float(ok), True, {"success": ok})
        return super().step(action)

    def _final(self, action: str) -> StepResult:  # neither an answer nor a search: the episode fails
        return StepResult("", 0.0, True, {"success": False})


@functools.lru_cache(maxsize=8)
def _index(corpus: str, text_key: str) -> BM25Index:
    return BM25Index.from_jsonl(corpus, text_key=text_key)


@register_environment("search_r1", capabilities=EnvCapabilities(reports_success=True))
def search_r1(*, corpus: str, k: int = 2, text_key: str = "text", format: ToolFormatName = "hyperrl") -> SearchEnv:
    """Search-R1 over a JSONL ``corpus`` (one document per line, its text under ``text_key``);
    the BM25 index is built once per file and shared by every episode. ``format``: the tool-call
    format (``hyperrl`` compact tags, ``hermes`` through the chat template)."""
    return SearchEnv(_index(corpus, text_key), k=k, format=format)
