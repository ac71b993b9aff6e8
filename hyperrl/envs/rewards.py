"""Rewards: plain functions ``(response, sample) -> float`` registered by name."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator

from ..registry import Registry

__all__ = ["REWARDS", "register_reward", "extract_gsm8k_answer", "normalize_number", "gsm8k_exact", "first_char_exact",
           "starts_with_digit", "RewardName"]

REWARDS: Registry = Registry("reward function")
register_reward = REWARDS.register


def _known_reward(name: str) -> str:
    if name not in REWARDS:
        raise ValueError(f"unknown reward function {name!r}; registered: {REWARDS.names()}")
    return name


RewardName = Annotated[str, AfterValidator(_known_reward)]  # a hyperparameter naming a registered reward

_HASH = re.compile(r"####\s*([-+]?[\$\d][\d,\$]*(?:\.\d+)?)")
_NUM = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """Strip ``,`` and ``$``; canonical decimal string (``"1,000.50" → "1000.5"``), or None."""
    s = text.replace(",", "").replace("$", "").strip()
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    d = d.normalize()
    return format(d, "f") if d != d.to_integral() else str(int(d))


def extract_gsm8k_answer(response: str) -> str | None:
    """GSM8K answer: the number after ``####``, else the last number in the text (normalised)."""
    m = _HASH.search(response)
    if m:
        return normalize_number(m.group(1))
    nums = _NUM.findall(response)
    return normalize_number(nums[-1]) if nums else None


@register_reward("gsm8k_exact")
def gsm8k_exact(response: str, sample) -> float:
    """1.0 when the extracted answer equals the sample's (normalised) ground truth, else 0.0."""
    truth = sample.answer if hasattr(sample, "answer") else sample["answer"]
    want = extract_gsm8k_answer(str(truth))
    got = extract_gsm8k_answer(response)
    return float(got is not None and got == want)


@register_reward("first_char_exact")
def first_char_exact(response: str, sample) -> float:
    """1.0 when the response's first character is the answer (the ``modsum`` task's reward)."""
    return float(response[:1] == str(sample.answer))


@register_reward("starts_with_digit")
def starts_with_digit(response: str, sample) -> float:
    """A format reward: 1.0 when the response starts with a digit."""
    return float(response[:1].isdigit())
