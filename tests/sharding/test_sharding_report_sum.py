"""``report._sum_by``: values summed by key — the counting fast path (small non-negative integer keys, rank
numbers) equals the sorting one (``np.unique``) for every input; large or negative keys take the sort."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.sharding.report import _sum_by


def _by_sort(keys, values):
    u, inv = np.unique(keys, return_inverse=True)
    return u.tolist(), np.bincount(inv.reshape(-1), weights=values).astype(np.int64).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 1 << 20), st.integers(0, 1 << 40)), min_size=1, max_size=60))
def test_sum_by_counts_keys_exactly_as_the_sort_does(pairs):
    keys = np.array([k for k, _ in pairs], np.int64)
    values = np.array([v for _, v in pairs], np.int64)
    assert _sum_by(keys, values) == _by_sort(keys, values)


def test_a_key_whose_values_sum_to_zero_is_still_listed():
    # ranks 0 and 5 send; rank 5's transfers are all empty — it is still a sender (by hand: {0: 7, 5: 0})
    assert _sum_by(np.array([5, 0, 5]), np.array([0, 7, 0])) == ([0, 5], [7, 0])
    assert _sum_by(np.array([], np.int64), np.array([], np.int64)) == ([], [])
