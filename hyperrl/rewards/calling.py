"""Calling a reward function the way its style says: the calling conventions (``rewards[].style``) as registered
:class:`RewardStyle` classes — ``trl`` (once per batch, by keyword), ``verl`` (per sample, ``compute_score``'s
arguments), ``hyperrl`` (per sample, ``fn(response, sample)``) — each with the check of a function's signature
against it; every returned value checked (a finite number, or None from a reward that abstains), every call within
its deadline, a failure of the user's code a :class:`RewardError` naming the reward and the row.
:mod:`hyperrl.rewards.styles` resolves a config's rewards; :mod:`hyperrl.rewards.scoring` scores batches with them.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hyperrl.errors import HyperRLError
from hyperrl.registry import Registry
from hyperrl.rewards.runners import RUNNERS, Call

__all__ = ["Reward", "RewardError", "RewardStyle", "REWARD_STYLES", "register_reward_style", "call_reward",
           "check_value", "invoke", "failure_error", "source_of", "style_of", "check_signature", "reward_style", "Call"]


class RewardError(HyperRLError, ValueError):
    """A reward that cannot be loaded, raised, or returned something unusable; the message names
    the reward and the row (``row``: the batch row, when one is to blame; the loop adds the step
    and the row's ``sample_uid`` and data source)."""

    def __init__(self, msg: str, *, row: int | None = None):
        super().__init__(msg)
        self.row = row


@dataclass(frozen=True)
class Reward:
    """One resolved reward of a config's ``rewards:`` list: its metric ``name``, the function ``fn`` (None when
    not built) and its calling ``style``, ``weight`` in ``Σ_k w_k · r_k``, the ``data_sources`` it scores (None:
    all) and the ``kwargs`` passed on every call."""

    name: str
    fn: Callable
    style: str  # trl | verl | hyperrl
    weight: float = 1.0
    data_sources: tuple[str, ...] | None = None
    kwargs: dict = field(default_factory=dict)
    abstains: bool = False  # None for a row = not applicable (counted), not an error
    timeout_s: float | None = None  # a call past this is stopped and reported
    workers: int = 0  # calls at once (0: on the caller's thread, one after another); see hyperrl.rewards.runners
    pool: str = "thread"  # where pooled calls run: a registered runner (thread | process)
    retries: int = 0  # a failed call (raised, timed out, its worker died) is made again this many times at most
    on_error: str = "raise"  # after its retries a failed call raises, or its rows abstain (counted)
    batch: int | None = None  # rows per call of a batch-style reward (None: all; pooled: an equal share per worker)
    recipe: bytes | None = field(default=None, repr=False, compare=False)  # how a worker process rebuilds fn

    @property
    def runner_kind(self) -> str:
        """Where its calls run: ``process`` (``workers`` worker processes), ``async`` (an ``async def`` function:
        the event loop), ``inline`` (``workers: 0``) or ``pool``."""
        if self.workers and self.pool == "process":
            return "process"
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__):
            return "async"
        return "inline" if self.workers == 0 else self.pool

    def batch_rows(self, n: int) -> int:
        """Rows per call of a batch-style reward over ``n`` rows."""
        if self.batch:
            return self.batch
        return -(-n // self.workers) if self.workers > 1 and self.runner_kind != "async" else max(n, 1)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def source_of(sample) -> str | None:
    """A sample's ``data_source`` (None: none)."""
    return (getattr(sample, "extra", None) or {}).get("data_source")


def check_value(v, reward: Reward, row: int) -> tuple[float | None, dict]:
    """One returned value → (a finite float, or None when the reward abstains; a verl dict's extras)."""
    if type(v) is float and v - v == 0.0:  # the common case first: a finite float (inf − inf and NaN are NaN)
        return v, {}
    extra = {}
    if isinstance(v, dict) and reward_style(reward.style).scores_dicts:
        if "score" not in v:
            raise RewardError(f"reward {reward.name!r} returned a dict without 'score' (keys {sorted(v)})", row=row)
        extra = {k: float(x) for k, x in v.items() if k != "score" and isinstance(x, int | float | bool)}
        v = v["score"]
    if v is None:
        if reward.abstains:
            return None, extra
        raise RewardError(f"reward {reward.name!r} returned None; return a number, or declare that it "
                          "abstains on rows it does not score (rewards[].abstains: true — they count as not "
                          "applicable)", row=row)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if not isinstance(v, int | float | bool):
        raise RewardError(f"reward {reward.name!r} returned {type(v).__name__} {_short(v)}; expected a number",
                          row=row)
    if not math.isfinite(float(v)):
        raise RewardError(f"reward {reward.name!r} returned {v}; rewards must be finite (a NaN or "
                          "an infinity is never trained on as 0)", row=row)
    return float(v), extra


def call_reward(reward: Reward, prompts, texts, ids, samples) -> tuple[list, list[dict]]:
    """One reward over the rows it applies to, called as its style calls it, on the caller's thread (each call
    through :func:`invoke`): values (float | None) and per-row extras. Every input is a copy: a reward that mutates
    its arguments cannot change the dataset. (:class:`hyperrl.rewards.RewardSet` runs the same calls on the reward's
    runner.)"""
    import copy

    prompts, samples = copy.deepcopy(list(prompts)), copy.deepcopy(list(samples))
    conv = reward_style(reward.style)
    vals = [v for c in conv.make_calls(reward, prompts, texts, ids, samples)
            for v in conv.read(reward, c, invoke(reward, c))]
    return [v for v, _ in vals], [e for _, e in vals]


def failure_error(reward: Reward, call: Call, failure: str) -> RewardError:
    """The :class:`RewardError` of a failed call: the reward, what happened, and its row (or its rows' count)."""
    if len(call.rows) == 1 and reward_style(reward.style).per_row:
        return RewardError(f"reward {reward.name!r} {failure}", row=call.rows[0])
    return RewardError(f"reward {reward.name!r} {failure} (one call on {len(call.rows)} rows)")


def invoke(reward: Reward, call: Call):
    """``reward.fn(*call.args, **call.kwargs)`` here and now, within ``reward.timeout_s`` (on the main thread); a
    failure — an exception from the user's code, the deadline — is a :class:`RewardError` naming the reward (and
    the row, for a per-sample style)."""
    o = RUNNERS.get("inline")(reward.fn, workers=0, timeout_s=reward.timeout_s).start(call).result()
    if o.failure is None:
        return o.value
    if isinstance(o.error, RewardError):
        raise o.error
    raise failure_error(reward, call, o.failure) from o.error


class RewardStyle(ABC):
    """A calling convention of reward functions (``rewards[].style``), registered in ``REWARD_STYLES``:
    ``make_calls(reward, prompts, texts, ids, samples)`` → the :class:`~hyperrl.rewards.runners.Call` s that score the
    rows (one per row when ``per_row``, else chunks of ``reward.batch_rows(n)``); ``read(reward, call, out)`` → one
    ``(value, extras)`` per row of the call (each value read by :func:`check_value`); ``unfit(sig, kwargs)`` — why
    a function of signature ``sig`` cannot be called so (None: it can); ``fits(params)`` — a registered function
    with these parameters is of this style (styles are tried in registration order); ``calls`` — the call, as
    messages show it; ``scores_dicts`` — a returned dict's ``score`` is the value (its other numeric keys logged);
    ``splits_tokens`` — a function's ``token_credit`` attribute spreads its value over the response tokens."""

    calls = ""
    scores_dicts = False
    splits_tokens = False
    per_row = True

    @abstractmethod
    def make_calls(self, reward: Reward, prompts: list, texts: list[str], ids: list, samples: list) -> list[Call]:
        """The calls of ``reward.fn`` that score the rows."""

    def read(self, reward: Reward, call: Call, out) -> list[tuple]:
        """What ``call`` returned → one ``(value or None, extras)`` per row of the call."""
        return [check_value(out, reward, call.rows[0])]

    def unfit(self, sig: inspect.Signature, kwargs: dict) -> str | None:
        """Why a function of signature ``sig`` cannot be called this way (None: it can)."""
        return None

    def fits(self, params) -> bool:
        """A registered function with these parameters is of this style."""
        return False


REWARD_STYLES: Registry = Registry("reward style")
register_reward_style = REWARD_STYLES.register


def reward_style(name: str) -> RewardStyle:
    """The registered style ``name``, ready to call (an unknown name: a ``KeyError`` listing the registered ones)."""
    return REWARD_STYLES.get(name)()


@register_reward_style("trl")
class TRLStyle(RewardStyle):
    """TRL's ``reward_funcs``: called once per batch, by keyword — prompts, completions (chat completions for chat
    prompts), completion ids and the dataset's other columns plus ``answer`` — returning one value per row."""

    calls, per_row = "fn(prompts=, completions=, completion_ids=, **columns)", False

    def make_calls(self, reward, prompts, texts, ids, samples):
        chat = [isinstance(p, list) for p in prompts]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        keys = sorted({k for s in samples for k in (s.extra or {}) if k not in ("prompt",)})
        columns = {k: [(s.extra or {}).get(k) for s in samples] for k in keys}
        columns["answer"] = [s.answer for s in samples]
        size, out = reward.batch_rows(len(texts)), []
        for a in range(0, len(texts), size):
            cut = slice(a, a + size)
            out.append(Call(tuple(range(a, min(a + size, len(texts)))), (), dict(
                prompts=prompts[cut], completions=completions[cut], completion_ids=[list(i) for i in ids[cut]],
                **{k: v[cut] for k, v in columns.items()}, **reward.kwargs)))
        return out

    def read(self, reward, call, out):
        n = len(call.rows)
        if isinstance(out, torch.Tensor):
            out = out.tolist() if out.dim() == 1 else out
        if not isinstance(out, list | tuple):
            raise RewardError(f"reward {reward.name!r} (trl style) returned {type(out).__name__} {_short(out)}; "
                              f"expected a list of {n} numbers (one per completion)")
        if len(out) != n:
            raise RewardError(f"reward {reward.name!r} returned {len(out)} values for {n} completions")
        return [check_value(v, reward, i) for i, v in zip(call.rows, out)]

    def unfit(self, sig, kwargs):
        ps = sig.parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps.values())
        required = {n for n, p in ps.items() if p.default is inspect.Parameter.empty and p.kind in
                    (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
        if "completions" not in ps and not var_kw:
            return "it has no 'completions' parameter (and no **kwargs)"
        if required & {"solution_str", "ground_truth", "response", "sample"}:
            return f"it requires {sorted(required & {'solution_str', 'ground_truth', 'response', 'sample'})}"
        if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in ps.values()):
            return "it has positional-only parameters (TRL passes every argument by keyword)"
        return None

    def fits(self, params):
        return "completions" in params


def _binds(sig: inspect.Signature, *args, **kwargs) -> str | None:
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


@register_reward_style("verl")
class VerlStyle(RewardStyle):
    """verl's ``compute_score``: per sample, ``fn(data_source, solution_str, ground_truth, extra_info)`` → a float
    or a dict whose ``score`` is the value."""

    calls, scores_dicts = "fn(data_source=, solution_str=, ground_truth=, extra_info=)", True

    def make_calls(self, reward, prompts, texts, ids, samples):
        return [Call((i,), (), dict(data_source=source_of(s), solution_str=t, ground_truth=s.answer,
                                    extra_info=(s.extra or {}).get("extra_info"), **reward.kwargs))
                for i, (t, s) in enumerate(zip(texts, samples))]

    def unfit(self, sig, kwargs):
        return _binds(sig, data_source=None, solution_str="", ground_truth=None, extra_info=None, **kwargs)

    def fits(self, params):
        return "solution_str" in params


@register_reward_style("hyperrl")
class HyperRLStyle(RewardStyle):
    """hyperrl's own: per sample, ``fn(response, sample)`` → a float; a function's ``token_credit(pieces, sample)``
    (e.g. ``digit_credit``) spreads it over the response tokens."""

    calls, splits_tokens = "fn(response, sample)", True

    def make_calls(self, reward, prompts, texts, ids, samples):
        kw = reward.kwargs  # shared: a call passes it on by ** (a copy), never changes it
        return [Call((i,), (t, s), kw) for i, (t, s) in enumerate(zip(texts, samples))]

    def unfit(self, sig, kwargs):
        return _binds(sig, "", None, **kwargs)

    def fits(self, params):
        return True


def style_of(fn: Callable) -> str:
    """A registered function's style from its signature: the first registered style it fits (trl: a
    ``completions`` parameter; verl: ``solution_str``; else hyperrl)."""
    params = inspect.signature(fn).parameters
    return next(n for n in REWARD_STYLES.in_order() if reward_style(n).fits(params))


def check_signature(fn: Callable, style: str, kwargs: dict, key: str) -> None:
    """Load time: ``fn`` can be called the way its declared ``style`` calls it (TRL: by keyword,
    with ``completions`` — the dataset's columns may fill other parameters; verl: the four
    keywords; hyperrl: two positionals), else a :class:`RewardError` naming the style that fits."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    conv = reward_style(style)
    why = conv.unfit(sig, kwargs)
    if why is not None:
        fits = style_of(fn)
        hint = f"; its signature looks {fits}-style: set style: {fits}" if fits != style else ""
        raise RewardError(f"{key}.style: {style} calls {conv.calls}, which {getattr(fn, '__name__', fn)}"
                          f"{sig} cannot take — {why}{hint}")


