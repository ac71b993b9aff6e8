"""The one reward registry, ``REWARDS``, and the built-in reward functions.

An entry is either a **reward function** — positional parameters, called as its style says
(hyperrl ``(response, sample)``, TRL ``(prompts, completions, …)``, verl ``(data_source,
solution_str, …)``; inferred from the signature) — or a **reward factory**: only keyword-only
parameters (its hyperparameters, the config's ``kwargs``), returning a TRL-style function
(``math_verify``, ``reward_model``; register with :func:`register_reward_factory`).
:func:`is_factory` tells them apart by that signature rule.
"""

from __future__ import annotations

import inspect
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator

from hyperrl.registry import Registry

__all__ = ["REWARDS", "register_reward", "register_reward_factory", "is_factory", "extract_gsm8k_answer",
           "normalize_number", "gsm8k_exact", "first_char_exact", "exact_answer", "digit_credit", "digit_match",
           "starts_with_digit", "RewardName"]

REWARDS: Registry = Registry("reward")
register_reward = REWARDS.register


def register_reward_factory(name: str, *, requires: tuple[tuple[str, str], ...] = ()):
    """Decorator: register a reward factory (keyword-only hyperparameters → a TRL-style function)."""

    def deco(fn):
        params = inspect.signature(fn).parameters.values()
        if any(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in params):
            raise TypeError(f"reward factory {name!r}: every parameter must be keyword-only (its hyperparameters)")
        return REWARDS.register(name, requires=requires)(fn)

    return deco


def is_factory(name: str) -> bool:
    """Is ``REWARDS[name]`` a factory (no positional parameters) rather than a reward function?"""
    fn = REWARDS.get(name)
    return not any(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              inspect.Parameter.VAR_POSITIONAL) for p in inspect.signature(fn).parameters.values())


def _known_reward(name: str) -> str:
    if name not in REWARDS or is_factory(name):
        names = [n for n in REWARDS.names() if not is_factory(n)]
        raise ValueError(f"unknown reward function {name!r}; registered functions: {names}")
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


@register_reward("exact_answer")
def exact_answer(response: str, sample) -> float:
    """1.0 when the response (special tokens dropped) is exactly the answer, else 0.0 — with
    ``rollout.max_new_tokens`` one more than the longest answer, a match has stopped (EOS): a
    longer or unfinished response differs (the ``arith`` task's reward)."""
    return float(response == str(sample.answer))


@register_reward("digit_credit")
def digit_credit(response: str, sample) -> float:
    """Dense credit for a numeric answer: the longest common prefix of ``response + EOS`` and
    ``answer + EOS``, over ``len(answer) + 1`` — each leading digit right earns a share and
    stopping after the last one earns the last share; 1.0 exactly when :func:`exact_answer` is 1.
    E.g. answer ``"85"``: ``"85"`` → 1, ``"8"`` → 1/3, ``"84"`` → 1/3, ``"851"`` → 2/3, ``"5"`` → 0."""
    ans, n = str(sample.answer), 0
    for r, a in zip(response + "\0", ans + "\0"):
        if r != a:
            break
        n += 1
    return n / (len(ans) + 1)


@register_reward("digit_match")
def digit_match(response: str, sample) -> float:
    """Dense credit position by position: the share of the ``len(answer) + 1`` positions of
    ``answer + EOS`` that ``response + EOS`` matches (a digit right after a wrong one still counts,
    unlike :func:`digit_credit`'s prefix) — meant for fixed-width answers (``task.pad``), where a
    position is a place value; 1.0 exactly when :func:`exact_answer` is 1.
    E.g. answer ``"085"``: ``"085"`` → 1, ``"075"`` → 3/4, ``"08"`` → 2/4, ``"0851"`` → 3/4."""
    ans, got = str(sample.answer) + "\0", response + "\0"
    return sum(a == r for a, r in zip(ans, got)) / len(ans)


def _digit_credit_tokens(pieces: list, sample) -> list[float]:
    """:func:`digit_credit` split over the response's tokens (``pieces``: each token's text, None
    for the stop token): a token earns the shares of the target characters it extends the matched
    prefix by; the stop earns the last share when it comes right after the whole answer. The
    shares sum to ``digit_credit(''.join(pieces), sample)`` (tested)."""
    target = str(sample.answer)
    share, pos, alive, out = 1 / (len(target) + 1), 0, True, []
    for p in pieces:
        gain = 0
        if alive and p is None:
            gain, alive = (1 if pos == len(target) else 0), False
        elif alive:
            for c in p:
                if pos < len(target) and c == target[pos]:
                    pos, gain = pos + 1, gain + 1
                else:
                    alive = False
                    break
        out.append(gain * share)
    return out


digit_credit.token_credit = _digit_credit_tokens  # per-token step rewards (process-supervised GRPO)


@register_reward("starts_with_digit")
def starts_with_digit(response: str, sample) -> float:
    """A format reward: 1.0 when the response starts with a digit."""
    return float(response[:1].isdigit())
