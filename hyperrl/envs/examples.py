"""Example environments: GSM8K with a calculator tool, and Search-R1-style retrieval."""

from __future__ import annotations

import functools
import re

from .base import StepResult, register_environment
from .rewards import gsm8k_exact
from .tools import BM25Index, ToolFormatName, ToolRunner, calculator_tool, make_search_tool

__all__ = ["GSM8KCalculatorEnv", "SearchEnv"]


def _question(sample, runner: ToolRunner):
    """The first prompt: the question text (compact format), or the sample's chat messages (a
    string becomes one user message) for a chat format, whose template lists ``runner``'s tools."""
    if runner.format.chat:
        return [{"role": "user", "content": sample.prompt}] if isinstance(sample.prompt, str) else list(sample.prompt)
    q = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    return f"{q}\n"


@register_environment("gsm8k_calculator")
class GSM8KCalculatorEnv:
    """The model may call the calculator — ``format="hyperrl"``: ``<tool>{"name": "calculator",
    "arguments": {"expression": ...}}</tool>``, each result back as ``<result>…</result>``;
    ``format="hermes"``: ``<tool_call>{...}</tool_call>`` with the tool listed by the chat
    template and results as ``tool`` messages. The episode ends when the response has no tool
    call; reward = GSM8K exact match of that final response (``#### n`` or the last number), plus
    ``invalid_reward`` per failed tool call."""

    def __init__(self, *, invalid_reward: float = 0.0, max_calls_per_turn: int = 2, format: ToolFormatName = "hyperrl"):
        self.runner = ToolRunner({"calculator": calculator_tool}, max_calls_per_turn=max_calls_per_turn, fmt=format)
        self.tools = self.runner.specs() if self.runner.format.chat else None
        self.invalid_reward = invalid_reward
        self.sample = None

    def reset(self, sample):
        self.sample = sample
        return _question(sample, self.runner)

    def step(self, action: str) -> StepResult:
        results = self.runner.run(action)
        if not results:
            return StepResult("", gsm8k_exact(action, self.sample), True)
        penalty = self.invalid_reward * sum(not r.ok for r in results)
        return StepResult(self.runner.format.observation(results), penalty, False, {"tool_calls": len(results)})


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class SearchEnv:
    """Search-R1 style: ``<tool>{"name": "search", "arguments": {"query": ...}}</tool>`` returns BM25
    passages in ``<result>``; ``<answer>…</answer>`` ends the episode with exact-match reward."""

    def __init__(self, index: BM25Index, *, k: int = 2, format: str = "hyperrl"):
        self.runner = ToolRunner({"search": make_search_tool(index, k=k)}, max_calls_per_turn=1, fmt=format)
        self.tools = self.runner.specs() if self.runner.format.chat else None
        self.sample = None

    def reset(self, sample):
        self.sample = sample
        return _question(sample, self.runner)

    def step(self, action: str) -> StepResult:
        m = _ANSWER.search(action)
        if m:
            ok = m.group(1).strip().lower() == str(self.sample.answer).strip().lower()
            return StepResult("", float(ok), True)
        results = self.runner.run(action)
        if not results:
            return StepResult("", 0.0, True)
        return StepResult(self.runner.format.observation(results), 0.0, False)


@functools.lru_cache(maxsize=8)
def _index(corpus: str, text_key: str) -> BM25Index:
    return BM25Index.from_jsonl(corpus, text_key=text_key)


@register_environment("search_r1")
def search_r1(*, corpus: str, k: int = 2, text_key: str = "text", format: ToolFormatName = "hyperrl") -> SearchEnv:
    """Search-R1 over a JSONL ``corpus`` (one document per line, its text under ``text_key``);
    the BM25 index is built once per file and shared by every episode. ``format``: the tool-call
    format (``hyperrl`` compact tags, ``hermes`` through the chat template)."""
    return SearchEnv(_index(corpus, text_key), k=k, format=format)
