import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.transforms import (
    KL_ESTIMATORS,
    adaptive_kl_init,
    adaptive_kl_update,
    fixed_kl_init,
    fixed_kl_update,
    is_corrected_kl,
    kl_penalty,
)

floats = st.floats(-30, 30, allow_nan=False, width=32)


@given(st.lists(floats, min_size=1, max_size=20), st.lists(floats, min_size=1, max_size=20))
def test_k2_k3_nonnegative_and_zero_at_ref(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    for est in ("k2", "k3", "abs"):
        kl = kl_penalty(lp, ref, est, clamp_input=20.0)
        assert (kl >= 0).all(), est
        assert (kl_penalty(lp, lp, est) == 0).all()


def test_k3_nonnegative_near_zero():
    d = torch.tensor([1e-6, -1e-6, 3e-8, -7e-7, 1e-4])
    assert (kl_penalty(d, torch.zeros(5), "k3") >= 0).all()


def test_golden():
    # d = lp - ref = log 2: k1 = 0.6931, k2 = 0.2402, k3 = 1/2 + log 2 - 1 = 0.1931
    lp, ref = torch.log(torch.tensor([2.0])), torch.zeros(1)
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([0.693147]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.240227]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([0.193147]))
    # verl low_var_kl clamps: d = -30 -> clamp to -20, k3 = e^20 - 21 -> clamp to 10
    assert float(kl_penalty(torch.tensor([-30.0]), torch.zeros(1), "k3", clamp_input=20, clamp_output=10)) == 10


@pytest.mark.parametrize("base", ["k1", "k3", "abs"])
def test_straight_through_value_of_kx_gradient_of_k2(base):
    d0 = torch.tensor([0.3, -0.7, 1.2])
    lp = d0.clone().requires_grad_(True)
    st_kl = kl_penalty(lp, torch.zeros(3), base + "+")
    torch.testing.assert_close(st_kl.detach(), kl_penalty(d0, torch.zeros(3), base))
    (g,) = torch.autograd.grad(st_kl.sum(), lp)
    torch.testing.assert_close(g, d0)  # d/dd of ½d² is d


def test_is_corrected_kl_on_policy_equals_k3():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(is_corrected_kl(lp, lp, ref), kl_penalty(lp, ref, "k3"))


def test_controllers_are_pure():
    s0 = adaptive_kl_init(0.1)
    s1 = adaptive_kl_update(s0, kl=0.2, n_steps=10, target=0.1, horizon=100)  # err clipped to 0.2
    assert s0.beta == 0.1 and s1.beta == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    s2 = adaptive_kl_update(s0, kl=0.09, n_steps=10, target=0.1, horizon=100)  # err = -0.1
    assert s2.beta == pytest.approx(0.1 * (1 - 0.1 * 10 / 100))
    assert fixed_kl_update(fixed_kl_init(0.3), 5.0, 100).beta == 0.3
    with pytest.raises(ValueError, match="target"):
        adaptive_kl_update(s0, 0.1, 1, target=0.0, horizon=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s0.beta = 3.0  # frozen


def test_registry_lists_estimators():
    assert {"k1", "k2", "k3", "abs"} <= set(KL_ESTIMATORS.names())
