"""Rewards as users write them: TRL-style, verl-style and hyperrl-style functions, from a file or a
registry, weighted, routed by ``data_source``, batched; a reward model; math-verify.

A config's ``rewards:`` list (:class:`hyperrl.config.RewardSpec`) names each reward:

* ``fn: "my_rewards.py:accuracy"`` — a function from a file (``style`` says how it is called), or
  a registered name in ``REWARDS``: a reward function (its style from its signature) or a reward
  factory whose hyperparameters are the spec's ``kwargs`` (``math_verify``, ``reward_model``).
* ``style``: ``trl`` — ``fn(prompts, completions, completion_ids, **columns, **kwargs) -> list[float
  | None]`` called once per batch (TRL's ``reward_funcs``; ``None`` = not applicable; chat prompts
  give chat completions ``[{"role": "assistant", "content": ...}]``; ``None`` only with ``abstains:
  true``, else an error; ``columns`` are the dataset's
  other columns plus ``answer``); ``verl`` — ``fn(data_source, solution_str, ground_truth,
  extra_info, **kwargs) -> float | {"score": float, ...}`` per sample (verl's ``compute_score``;
  a dict's other numeric keys are logged); ``hyperrl`` — ``fn(response, sample, **kwargs) -> float``.
* ``weight`` (the reward is ``Σ_k w_k · r_k`` over the applicable ones), ``data_source`` (only
  samples of those sources are scored; the rest get ``None``), ``name`` (its metric:
  ``reward_<name>_mean`` over the samples it applies to).

:meth:`RewardSet.score` returns ``reward_components [B, K]`` (unweighted; 0 where not applicable:
TRL's ``nansum``), the applicability mask, and the metrics. A reward returning the wrong length
or type, a NaN, or a file that does not import is an error naming the reward, the row or the file.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hyperrl.errors import HyperRLError
from hyperrl.registry import Registry
from hyperrl.rewards.builtin import REWARDS, is_factory, register_reward_factory

__all__ = ["Reward", "RewardSet", "RewardError", "load_function", "build_rewards", "check_rewards", "REWARD_STYLES",
           "RewardStyle", "register_reward_style"]



class RewardError(HyperRLError, ValueError):
    """A reward that cannot be loaded, raised, or returned something unusable; the message names
    the reward and the row (``row``: the batch row, when one is to blame; the loop adds the step
    and the row's ``sample_uid`` and data source)."""

    def __init__(self, msg: str, *, row: int | None = None):
        super().__init__(msg)
        self.row = row


def load_function(ref: str, where: str) -> Callable:
    """``"path/to/file.py:name"`` → the function (the file imported once, as its own module)."""
    path, _, attr = ref.rpartition(":")
    p = Path(path)
    if not p.is_file():
        raise RewardError(f"{where}: {p} does not exist (expected 'path/to/file.py:function')")
    mod_name = f"hyperrl_user_{abs(hash(str(p.resolve())))}"
    mod = sys.modules.get(mod_name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(mod_name, p)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's file's
            raise RewardError(f"{where}: importing {p} failed: {type(e).__name__}: {e}") from None
        sys.modules[mod_name] = mod
    fn = getattr(mod, attr, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"{where}: {p} has no function {attr!r} (it defines {names})")
    return fn


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
    timeout_s: float | None = None  # a call past this is stopped and reported (main thread: SIGALRM)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _source(sample) -> str | None:
    return (getattr(sample, "extra", None) or {}).get("data_source")


def _value(v, reward: Reward, row: int) -> tuple[float | None, dict]:
    """One returned value → (a finite float, or None when the reward abstains; a verl dict's extras)."""
    extra = {}
    if isinstance(v, dict) and REWARD_STYLES.get(reward.style).scores_dicts:
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


class _Deadline(Exception):
    pass


class _deadline:
    """Stop what runs inside after ``seconds`` (``SIGALRM`` through a real-time interval timer, on
    the main thread, where Python delivers signals; elsewhere no limit can be enforced in-process and
    none is set). Python code and sleeps are interrupted; a C extension that never returns to the
    interpreter is not — run such a reward in its own process."""

    def __init__(self, seconds: float | None):
        import threading

        self.seconds = seconds if seconds and threading.current_thread() is threading.main_thread() else None

    def __enter__(self):
        import signal

        if self.seconds:
            def fire(signum, frame):
                raise _Deadline()

            self._old = signal.signal(signal.SIGALRM, fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        import signal

        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
        return False


def _invoke(reward: Reward, row: int | None, *args, **kwargs):
    """``reward.fn(...)`` within ``reward.timeout_s``; an exception from the user's code — or the
    deadline — becomes a :class:`RewardError` naming the reward (and the row, for a per-sample style)."""
    try:
        with _deadline(reward.timeout_s):
            return reward.fn(*args, **kwargs)
    except RewardError:
        raise
    except _Deadline:
        where = "" if row is not None else f" (one call on {len(kwargs.get('completions', []))} rows)"
        raise RewardError(f"reward {reward.name!r} did not return within rewards[].timeout_s={reward.timeout_s} s"
                          f"{where}; it was stopped — make it faster or raise its timeout_s", row=row) from None
    except Exception as e:  # noqa: BLE001 - any failure in user code is reported as the reward's
        where = "" if row is not None else f" (one call on {len(kwargs.get('completions', []))} rows)"
        raise RewardError(f"reward {reward.name!r} raised {type(e).__name__}: {e}{where}", row=row) from e


def _call(reward: Reward, prompts, texts, ids, samples) -> tuple[list, list[dict]]:
    """One reward over the rows it applies to, called as its style calls it: values (float | None) and per-row
    extras. Every input is a copy: a reward that mutates its arguments cannot change the dataset."""
    import copy

    prompts, samples = copy.deepcopy(list(prompts)), copy.deepcopy(list(samples))
    vals = REWARD_STYLES.get(reward.style).call(reward, prompts, texts, ids, samples)
    return [v for v, _ in vals], [e for _, e in vals]


class RewardStyle:
    """A calling convention of reward functions (``rewards[].style``), registered in ``REWARD_STYLES``:
    ``call(reward, prompts, texts, ids, samples)`` → one ``(value, extras)`` per row (:func:`_value` reads each
    returned value); ``unfit(sig, kwargs)`` — why a function of signature ``sig`` cannot be called so (None: it
    can); ``fits(params)`` — a registered function with these parameters is of this style (styles are tried in
    registration order); ``calls`` — the call, as messages show it; ``scores_dicts`` — a returned dict's ``score``
    is the value (its other numeric keys logged); ``splits_tokens`` — a function's ``token_credit`` attribute
    spreads its value over the response tokens."""

    calls = ""
    scores_dicts = False
    splits_tokens = False

    @staticmethod
    def call(reward: Reward, prompts: list, texts: list[str], ids: list, samples: list) -> list[tuple]:
        """Call ``reward.fn`` on the rows."""
        raise NotImplementedError

    @staticmethod
    def unfit(sig: inspect.Signature, kwargs: dict) -> str | None:
        """Why a function of signature ``sig`` cannot be called this way (None: it can)."""
        return None

    @staticmethod
    def fits(params) -> bool:
        """A registered function with these parameters is of this style."""
        return False


REWARD_STYLES: Registry = Registry("reward style")
register_reward_style = REWARD_STYLES.register


@register_reward_style("trl")
class TRLStyle(RewardStyle):
    """TRL's ``reward_funcs``: called once per batch, by keyword — prompts, completions (chat completions for chat
    prompts), completion ids and the dataset's other columns plus ``answer`` — returning one value per row."""

    calls = "fn(prompts=, completions=, completion_ids=, **columns)"

    @staticmethod
    def call(reward, prompts, texts, ids, samples):
        n = len(texts)
        chat = [isinstance(p, list) for p in prompts]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        keys = sorted({k for s in samples for k in (s.extra or {}) if k not in ("prompt",)})
        columns = {k: [(s.extra or {}).get(k) for s in samples] for k in keys}
        columns["answer"] = [s.answer for s in samples]
        out = _invoke(reward, None, prompts=prompts, completions=completions, completion_ids=[list(i) for i in ids],
                      **columns, **reward.kwargs)
        if isinstance(out, torch.Tensor):
            out = out.tolist() if out.dim() == 1 else out
        if not isinstance(out, list | tuple):
            raise RewardError(f"reward {reward.name!r} (trl style) returned {type(out).__name__} {_short(out)}; "
                              f"expected a list of {n} numbers (one per completion)")
        if len(out) != n:
            raise RewardError(f"reward {reward.name!r} returned {len(out)} values for {n} completions")
        return [_value(v, reward, i) for i, v in enumerate(out)]

    @staticmethod
    def unfit(sig, kwargs):
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

    @staticmethod
    def fits(params):
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

    @staticmethod
    def call(reward, prompts, texts, ids, samples):
        return [_value(_invoke(reward, i, data_source=_source(s), solution_str=t, ground_truth=s.answer,
                               extra_info=(s.extra or {}).get("extra_info"), **reward.kwargs), reward, i)
                for i, (t, s) in enumerate(zip(texts, samples))]

    @staticmethod
    def unfit(sig, kwargs):
        return _binds(sig, data_source=None, solution_str="", ground_truth=None, extra_info=None, **kwargs)

    @staticmethod
    def fits(params):
        return "solution_str" in params


@register_reward_style("hyperrl")
class HyperRLStyle(RewardStyle):
    """hyperrl's own: per sample, ``fn(response, sample)`` → a float; a function's ``token_credit(pieces, sample)``
    (e.g. ``digit_credit``) spreads it over the response tokens."""

    calls, splits_tokens = "fn(response, sample)", True

    @staticmethod
    def call(reward, prompts, texts, ids, samples):
        return [_value(_invoke(reward, i, t, s, **reward.kwargs), reward, i) for i, (t, s) in enumerate(zip(texts,
                                                                                                          samples))]

    @staticmethod
    def unfit(sig, kwargs):
        return _binds(sig, "", None, **kwargs)

    @staticmethod
    def fits(params):
        return True


@dataclass(frozen=True)
class RewardSet:
    """Several rewards scored together: ``score`` → (components ``[B, K]``, applicable ``[B, K]``,
    metrics). The total reward is ``(components · weights).sum(-1)``."""

    rewards: tuple[Reward, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rewards)

    @property
    def weights(self) -> torch.Tensor:
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)

    def score(self, prompts: list, texts: list[str], ids: list[list[int]], samples: list):
        B, K = len(texts), len(self.rewards)
        comps, applicable = torch.zeros(B, K), torch.zeros(B, K, dtype=torch.bool)
        metrics: dict[str, float] = {}
        for k, r in enumerate(self.rewards):
            rows = [i for i, s in enumerate(samples) if r.data_sources is None or _source(s) in r.data_sources]
            if not rows:
                continue
            try:
                vals, extras = _call(r, [prompts[i] for i in rows], [texts[i] for i in rows],
                                     [ids[i] for i in rows], [samples[i] for i in rows])
            except RewardError as e:  # the row within this reward's rows → the batch row
                if e.row is None:
                    raise
                raise RewardError(f"{e} — batch row {rows[e.row]}", row=rows[e.row]) from e
            got = [(i, float(v)) for i, v in zip(rows, vals) if v is not None]  # one write per reward, not per row
            if got:
                idx = torch.tensor([i for i, _ in got])
                comps[idx, k] = torch.tensor([v for _, v in got])
                applicable[idx, k] = True
            for key in sorted({key for e in extras for key in e}):
                got = [e[key] for e in extras if key in e]
                metrics[f"reward_{r.name}_{key}_mean"] = sum(got) / len(got)
        return comps, applicable, metrics

    def token_rewards(self, pieces: list[list], samples: list, comps: torch.Tensor,
                      applicable: torch.Tensor) -> list[list[float]]:
        """Step rewards per response token, ``Σ_t = `` the row's total reward: each reward with a
        ``token_credit(pieces, sample)`` split (a registered function's attribute, e.g.
        ``digit_credit``) spreads its weighted value over the tokens; every other reward lands on
        the last token (verl's outcome placement). ``pieces[i]``: row i's token texts (None = stop)."""
        out = []
        for i, (row, s) in enumerate(zip(pieces, samples)):
            credit, rest = [0.0] * len(row), 0.0
            for k, r in enumerate(self.rewards):
                split = getattr(r.fn, "token_credit", None) if REWARD_STYLES.get(r.style).splits_tokens else None
                if not bool(applicable[i, k]):
                    continue
                if split is None or not row:
                    rest += r.weight * float(comps[i, k])
                    continue
                for t, v in enumerate(split(row, s, **r.kwargs)):
                    credit[t] += r.weight * v
            if row:
                credit[-1] += rest
            out.append(credit)
        return out

    def total(self, comps: torch.Tensor) -> torch.Tensor:
        return (comps * self.weights).sum(-1)


def _style_of(fn: Callable) -> str:
    """A registered function's style from its signature: the first registered style it fits (trl: a
    ``completions`` parameter; verl: ``solution_str``; else hyperrl)."""
    params = inspect.signature(fn).parameters
    return next(n for n in REWARD_STYLES.in_order() if REWARD_STYLES.get(n).fits(params))


def _check_signature(fn: Callable, style: str, kwargs: dict, key: str) -> None:
    """Load time: ``fn`` can be called the way its declared ``style`` calls it (TRL: by keyword,
    with ``completions`` — the dataset's columns may fill other parameters; verl: the four
    keywords; hyperrl: two positionals), else a :class:`RewardError` naming the style that fits."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    conv = REWARD_STYLES.get(style)
    why = conv.unfit(sig, kwargs)
    if why is not None:
        fits = _style_of(fn)
        hint = f"; its signature looks {fits}-style: set style: {fits}" if fits != style else ""
        raise RewardError(f"{key}.style: {style} calls {conv.calls}, which {getattr(fn, '__name__', fn)}"
                          f"{sig} cannot take — {why}{hint}")


def check_rewards(specs, where: str = "rewards") -> None:
    """Load time: every spec resolves — files import, names are registered, factory
    hyperparameters and requirements check, names are distinct — without building reward models."""
    _resolve(specs, where, build=False)


def build_rewards(specs, where: str = "rewards") -> RewardSet:
    """Resolve the config's reward specs into a :class:`RewardSet` (imports files, builds reward
    models). Raises :class:`RewardError` naming ``rewards[i]``."""
    return RewardSet(tuple(_resolve(specs, where, build=True)))


def _resolve(specs, where: str, *, build: bool) -> list[Reward]:
    """The one walk over reward specs (``build=False``: a factory is checked, not called; its
    ``Reward.fn`` is None)."""
    out, seen = [], set()
    for i, spec in enumerate(specs):
        key = f"{where}[{i}]"
        ref, style, kwargs = spec.fn, spec.style, dict(spec.kwargs)
        if style is not None and style not in REWARD_STYLES:
            raise RewardError(f"{key}.style: {style!r} is not a registered reward style ({REWARD_STYLES.names()})")
        if ref.endswith(".py") or ".py:" in ref:
            if ":" not in ref:
                raise RewardError(f"{key}.fn: {ref!r} names a file but no function; write 'path/to/file.py:name'")
            if style is None:
                raise RewardError(f"{key}.style: a function from a file needs its calling convention: trl "
                                  "(prompts, completions, completion_ids, **columns), verl (data_source, solution_str, "
                                  "ground_truth, extra_info) or hyperrl (response, sample)")
            fn, name = load_function(ref, f"{key}.fn"), ref.rpartition(":")[2]
            _check_signature(fn, style, kwargs, key)
        elif ref in REWARDS and is_factory(ref):
            f = REWARDS.factory(ref)
            f.check(kwargs, f"{key}.kwargs")
            f.check_requirements(f"{key}.fn")
            fn, name = (REWARDS.build(ref, **kwargs)() if build else None), ref
            kwargs, style = {}, style or "trl"
        elif ref in REWARDS:
            fn, name = REWARDS.get(ref), ref
            style = style or _style_of(fn)
        else:
            raise RewardError(f"{key}.fn: {ref!r} is neither 'file.py:function' nor a registered reward "
                              f"({REWARDS.names()})")
        name = spec.name or name
        if name in seen:
            raise RewardError(f"{key}.name: two rewards are named {name!r}; give one a distinct name")
        seen.add(name)
        ds = spec.data_source
        sources = None if ds is None else ((ds,) if isinstance(ds, str) else tuple(ds))
        out.append(Reward(name, fn, style, float(spec.weight), sources, kwargs,
                          abstains=bool(getattr(spec, "abstains", False)), timeout_s=getattr(spec, "timeout_s", None)))
    return out


# ----------------------------------------------------------------------------- built-in factories

def _text_of(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


@register_reward_factory("math_verify", requires=(("math_verify", "`pip install 'hyperrl[math]'` (math-verify)"),))
def math_verify_reward(*, boxed_only: bool = False):
    """1.0 when the completion's final answer is mathematically equal to the sample's ``answer``
    (math-verify: ``\\boxed{}``, LaTeX and plain expressions, symbolic equivalence); 0.0 when not;
    ``boxed_only`` requires a ``\\boxed{}`` answer."""
    REWARDS.factory("math_verify").check_requirements("rewards.fn")
    from math_verify import parse, verify

    def math_verify(prompts, completions, answer, **kw):
        out = []
        for c, gold in zip(completions, answer):
            text = _text_of(c)
            if boxed_only and "\\boxed" not in text:
                out.append(0.0)
                continue
            g = parse(str(gold) if "$" in str(gold) or "\\" in str(gold) else f"${gold}$")
            out.append(float(bool(g) and verify(g, parse(text))))
        return out

    return math_verify


@register_reward_factory("reward_model")
def reward_model(*, path: str, batch_size: int = 16, max_length: int = 1024, device: str = "cpu"):
    """A discriminative reward model (``AutoModelForSequenceClassification`` + its tokenizer from a
    local directory): the score is logit 0 of prompt + completion (chat prompts rendered with the
    reward model's chat template), in batches of ``batch_size``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise RewardError(f"rewards.kwargs.path: {p} is not a model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(str(p))
    model = AutoModelForSequenceClassification.from_pretrained(str(p)).to(device).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id

    def text(prompt, completion) -> str:
        if isinstance(prompt, list) and getattr(tok, "chat_template", None):
            return tok.apply_chat_template([*prompt, {"role": "assistant", "content": _text_of(completion)}],
                                           tokenize=False)
        pre = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        return pre + _text_of(completion)

    @torch.no_grad()
    def reward_model(prompts, completions, **kw):
        texts = [text(p, c) for p, c in zip(prompts, completions)]
        out = []
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, truncation=True,
                      max_length=max_length).to(device)
            out += model(**enc).logits[:, 0].float().tolist()
        return out

    return reward_model
