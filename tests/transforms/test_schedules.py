import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.transforms.schedules import LR_SCHEDULES, lr_multiplier


def test_golden_values():
    # warmup 2 of total 7 → decay over k = 2..6, p = (k − 2) / 4
    assert [lr_multiplier(k, schedule="constant", total=7, warmup=2) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # linear to 0: p = 0, 1/4, 1/2, 3/4, 1 → 1, .75, .5, .25, 0
    assert [lr_multiplier(k, schedule="linear", total=7, warmup=2) for k in range(2, 7)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    # cosine to 0.1 at p = 1/2: 0.1 + 0.9 · (1 + cos(π/2)) / 2 = 0.55
    assert lr_multiplier(4, schedule="cosine", total=7, warmup=2, min_ratio=0.1) == pytest.approx(0.55)
    assert lr_multiplier(6, schedule="cosine", total=7, warmup=2, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_multiplier(50, schedule="linear", total=7, min_ratio=0.2) == pytest.approx(0.2)  # past the end: floor


@given(name=st.sampled_from(LR_SCHEDULES.names()), total=st.integers(1, 500), warmup=st.integers(0, 50),
       r=st.floats(0, 1))
def test_bounded_warmup_rises_decay_falls(name, total, warmup, r):
    ms = [lr_multiplier(k, schedule=name, total=total, warmup=warmup, min_ratio=r) for k in range(total + 5)]
    assert all(0 <= m <= 1 + 1e-12 for m in ms) and all(m > 0 for m in ms[:warmup])
    assert all(m >= r - 1e-12 for m in ms[warmup:])
    assert all(a < b for a, b in zip(ms[:warmup], ms[1:warmup]))  # warmup strictly increases
    assert all(a >= b - 1e-12 for a, b in zip(ms[warmup:], ms[warmup + 1:]))  # then never increases
    if warmup < total and name != "constant":
        assert math.isclose(ms[max(total - 1, warmup)], r if total - 1 > warmup else ms[warmup], abs_tol=1e-9)


def test_bad_arguments_are_named():
    with pytest.raises(KeyError, match="lr schedule"):
        lr_multiplier(0, schedule="cosin", total=3)
    with pytest.raises(ValueError, match="min_ratio=2"):
        lr_multiplier(0, total=3, min_ratio=2)
    with pytest.raises(ValueError, match="step -1"):
        lr_multiplier(-1, total=3)
