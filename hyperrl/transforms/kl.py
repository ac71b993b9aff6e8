"""KL estimators and KL-coefficient controllers.

Estimators take ``d = lp − ref`` (per token) and return a per-token KL estimate
(Schulman 2020, "Approximating KL divergence"):
``k1 = d``, ``abs = |d|``, ``k2 = ½d²``, ``k3 = exp(−d) + d − 1`` (≥ 0).
A trailing ``+`` (``"k1+"``, ``"k3+"``) is the straight-through form: the value of kX with the
gradient of k2, ``k2 − sg(k2) + sg(kX)``. Clamps are explicit arguments:
verl ``low_var_kl`` = k3 with ``clamp_input=20, clamp_output=10``; OpenRLHF clamps k3 to ±10.

Controllers are optax-style ``(init, update)`` pairs over a frozen :class:`KLState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hyperrl.registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "KL_CONTROLLERS",
    "register_kl_controller",
    "KLController",
    "fixed_controller",
    "adaptive_controller",
    "register_kl",
    "kl_penalty",
    "is_corrected_kl",
    "KLState",
    "fixed_kl_init",
    "fixed_kl_update",
    "adaptive_kl_init",
    "adaptive_kl_update",
]

KL_ESTIMATORS: Registry = Registry("KL estimator")
register_kl = KL_ESTIMATORS.register


@register_kl("k1")
def k1(d: torch.Tensor) -> torch.Tensor:
    """``k1 = d = log π − log π_ref`` per token (any shape, e.g. ``[B, T]``); may be negative."""
    return d


@register_kl("abs")
def kl_abs(d: torch.Tensor) -> torch.Tensor:
    """``abs = |d|``, ``d = log π − log π_ref``, per token (registered as ``"abs"``)."""
    return d.abs()


@register_kl("k2")
def k2(d: torch.Tensor) -> torch.Tensor:
    """``k2 = ½d²``, ``d = log π − log π_ref``, per token; the gradient of the straight-through ``"kX+"`` forms."""
    return 0.5 * d * d


@register_kl("k3")
def k3(d: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(−d) + d − 1 ≥ 0``, ``d = log π − log π_ref``, per token; with ``kl_penalty``'s clamps
    ``clamp_input=20, clamp_output=10`` it is verl's ``low_var_kl``."""
    # expm1(−d) + d: ≥ 0 in floating point too (exp(−d) + d − 1 rounds negative near d = 0)
    return torch.expm1(-d) + d


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    *,
    clamp_input: float | None = None,
    clamp_output: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` of the policy from the reference (see module doc)."""
    straight = isinstance(estimator, str) and estimator.endswith("+")
    fn = KL_ESTIMATORS.get(estimator[:-1] if straight else estimator)
    d = logprobs - ref_logprobs
    if clamp_input is not None:
        d = torch.clamp(d, -clamp_input, clamp_input)
    kl = fn(d)
    if clamp_output is not None:
        kl = torch.clamp(kl, -clamp_output, clamp_output)
    if straight:
        q = k2(d)
        kl = q - q.detach() + kl.detach()
    return kl


def is_corrected_kl(logprobs, old_logprobs, ref_logprobs, *, clamp: float = 20.0) -> torch.Tensor:
    """Unbiased off-policy KL (DeepSeek-V3.2): ``sg(π/π_old)·k3(lp − ref)`` per token."""
    w = torch.exp(torch.clamp(logprobs - old_logprobs, -clamp, clamp)).detach()
    return w * k3(logprobs - ref_logprobs)


@dataclass(frozen=True)
class KLState:
    """A KL controller's frozen state: the current coefficient β."""

    beta: float  # current KL coefficient β


def fixed_kl_init(beta: float) -> KLState:
    """The fixed controller's state: β = ``beta`` for the whole run."""
    return KLState(float(beta))


def fixed_kl_update(state: KLState, kl: float, n_steps: int) -> KLState:
    """Fixed controller: β never changes."""
    return state


def adaptive_kl_init(beta: float) -> KLState:
    """The adaptive controller's initial state: β = ``beta``."""
    return KLState(float(beta))


def adaptive_kl_update(state: KLState, kl: float, n_steps: int, *, target: float, horizon: float) -> KLState:
    """Adaptive controller (Ziegler et al. 2019): ``err = clip(KL/target − 1, ±0.2)``,
    ``β ← β·(1 + err·n_steps/horizon)``. Returns a new state."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"target={target}, horizon={horizon}: both must be > 0")
    err = min(max(float(kl) / target - 1.0, -0.2), 0.2)
    return KLState(state.beta * (1.0 + err * n_steps / horizon))


class KLController(NamedTuple):
    """An optax-style pair: ``init() -> KLState`` and ``update(state, kl, n_steps) -> KLState``."""

    init: Callable[[], KLState]
    update: Callable[[KLState, float, int], KLState]


KL_CONTROLLERS: Registry = Registry("KL controller")
register_kl_controller = KL_CONTROLLERS.register


@register_kl_controller("fixed")
def fixed_controller(beta: float) -> KLController:
    """β stays at its initial value (verl ``kl_ctrl.type=fixed``)."""
    return KLController(lambda: fixed_kl_init(beta), fixed_kl_update)


@register_kl_controller("adaptive")
def adaptive_controller(beta: float, *, target: float = 0.1, horizon: float = 10000.0) -> KLController:
    """Ziegler et al. 2019 (verl ``kl_ctrl.type=adaptive``, defaults target_kl 0.1, horizon 10000)."""
    if target <= 0 or horizon <= 0:
        raise ValueError(f"target={target}, horizon={horizon}: both must be > 0")
    return KLController(lambda: adaptive_kl_init(beta),
                        lambda s, kl, n: adaptive_kl_update(s, kl, n, target=target, horizon=horizon))
