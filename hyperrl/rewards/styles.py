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

:func:`build_rewards` resolves the list into a :class:`~hyperrl.rewards.scoring.RewardSet`, whose ``score``
returns ``reward_components [B, K]`` (unweighted; 0 where not applicable: TRL's ``nansum``), the applicability
mask, and the metrics (:mod:`hyperrl.rewards.scoring`). A reward returning the wrong length or type, a NaN, or a
file that does not import is an error naming the reward, the row or the file. How each style calls its functions
(and checks what they return) is :mod:`hyperrl.rewards.calling`'s.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from hyperrl.rewards import processes  # noqa: F401 - registers the `process` runner
from hyperrl.rewards.builtin import REWARDS, is_factory, register_reward_factory
from hyperrl.rewards.calling import (
    REWARD_STYLES,
    Reward,
    RewardError,
    RewardStyle,
    check_signature,
    register_reward_style,
    style_of,
)
from hyperrl.rewards.remote import CONTRACTS
from hyperrl.rewards.runners import RUNNERS
from hyperrl.rewards.scoring import RewardSet

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
        if getattr(spec, "url", None):  # a reward server: the `remote` factory, its contract named by `style`
            if style is not None and style not in CONTRACTS:
                raise RewardError(f"{key}.style: a url reward's style is its server's contract, one of "
                                  f"{CONTRACTS.names()} (got {style!r})")
            ref, kwargs = "remote", {"url": spec.url, "contract": style or "hyperrl", "timeout_s": spec.timeout_s,
                                     **kwargs}
            spec, style = spec.model_copy(update={"kwargs": kwargs}), None
        if getattr(spec, "judge", None) is not None:  # a judge model: the `judge` factory, abstaining when unsure
            if style is not None:
                raise RewardError(f"{key}.style: a judge reward has no style (its server or model is in judge:)")
            ref, kwargs = "judge", {"timeout_s": spec.timeout_s, **spec.judge}
            spec = spec.model_copy(update={"kwargs": kwargs})
        in_workers = getattr(spec, "pool", "thread") == "process" and getattr(spec, "workers", 0) > 0
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
            fn, name = (REWARDS.build(ref, **kwargs)() if build and not in_workers else None), ref  # built there
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
        pool = getattr(spec, "pool", "thread")
        if pool not in RUNNERS or pool in ("inline", "async"):
            raise RewardError(f"{key}.pool: {pool!r} is not a pool; use thread (rewards that wait: a sandbox, a "
                              "server) or process (CPU-bound Python: math-verify)")
        recipe = _recipe(ref, key, dict(spec.kwargs)) if in_workers else None
        declared = ref in REWARDS and getattr(REWARDS.get(ref), "abstains", False)  # a factory that may abstain
        out.append(Reward(name, fn, style, float(spec.weight), sources, kwargs,
                          abstains=bool(getattr(spec, "abstains", False) or declared),
                          timeout_s=getattr(spec, "timeout_s", None),
                          workers=getattr(spec, "workers", 0), pool=pool, retries=getattr(spec, "retries", 0),
                          on_error=getattr(spec, "on_error", "raise"), batch=getattr(spec, "batch", None),
                          recipe=recipe))
    return out


def _call_with(factory, kwargs):
    return factory(**kwargs)


def _same(fn):
    return fn


def _recipe(ref: str, key: str, kwargs: dict) -> bytes:
    """How a worker process rebuilds the reward (``pool: process``), pickled: a file's function loaded by its
    path, a registered factory called with its hyperparameters, a registered function by reference — the last two
    must come from an importable module (one defined in ``__main__`` is named here, at load)."""
    import pickle

    if ref.endswith(".py") or ".py:" in ref:
        return pickle.dumps((load_function, (ref, f"{key}.fn")))
    target = REWARDS.get(ref)
    mod = getattr(target, "__module__", None)
    if mod in (None, "__main__") or "<locals>" in getattr(target, "__qualname__", ""):
        raise RewardError(f"{key}: pool: process rebuilds the reward in a worker process, but {ref!r} is defined in "
                          f"{mod or 'no module'} ({getattr(target, '__qualname__', target)}), which a worker cannot "
                          "import; move it to a file (fn: path/to/file.py:name) or an importable module, or use "
                          "pool: thread")
    recipe = (_call_with, (target, kwargs)) if is_factory(ref) else (_same, (target,))
    try:
        return pickle.dumps(recipe)
    except Exception as e:  # noqa: BLE001 - the reason names what cannot be sent
        raise RewardError(f"{key}: pool: process cannot send {ref!r} to a worker process ({type(e).__name__}: "
                          f"{e}); use pool: thread") from None


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
