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
or type, a NaN, or a file that does not import is an error naming the reward, the row or the file. How each style
calls its functions (and checks what they return) is :mod:`hyperrl.rewards.calling`'s.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperrl.rewards.builtin import REWARDS, is_factory, register_reward_factory
from hyperrl.rewards.calling import (
    REWARD_STYLES,
    Reward,
    RewardError,
    RewardStyle,
    call_reward,
    check_signature,
    register_reward_style,
    reward_style,
    source_of,
    style_of,
)

__all__ = ["Reward", "RewardSet", "RewardError", "load_function", "build_rewards", "check_rewards", "REWARD_STYLES",
           "RewardStyle", "register_reward_style"]  # the calling conventions are :mod:`hyperrl.rewards.calling`'s



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
            rows = [i for i, s in enumerate(samples) if r.data_sources is None or source_of(s) in r.data_sources]
            if not rows:
                continue
            try:
                vals, extras = call_reward(r, [prompts[i] for i in rows], [texts[i] for i in rows],
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
        out, splits = [], [reward_style(r.style).splits_tokens for r in self.rewards]
        for i, (row, s) in enumerate(zip(pieces, samples)):
            credit, rest = [0.0] * len(row), 0.0
            for k, r in enumerate(self.rewards):
                split = getattr(r.fn, "token_credit", None) if splits[k] else None
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
            check_signature(fn, style, kwargs, key)
        elif ref in REWARDS and is_factory(ref):
            f = REWARDS.factory(ref)
            f.check(kwargs, f"{key}.kwargs")
            f.check_requirements(f"{key}.fn")
            fn, name = (REWARDS.build(ref, **kwargs)() if build else None), ref
            kwargs, style = {}, style or "trl"
        elif ref in REWARDS:
            fn, name = REWARDS.get(ref), ref
            style = style or style_of(fn)
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
