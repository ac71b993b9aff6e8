"""The pure pieces of asynchronous RL: staleness, A-3PO's proximal approximation, admission and the buffer."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.loop.admission import (
    admit,
    buffer_init,
    capacity,
    check_conservation,
    complete,
    evict,
    restart,
    take_batch,
    take_units,
)
from hyperrl.transforms.staleness import (
    NO_VERSION,
    interpolated_proximal_logprobs,
    proximal_alpha,
    row_policy_version,
    staleness_mask,
    staleness_metrics,
    token_staleness,
)

# ----------------------------------------------------------------------------- staleness


def _versions():
    # 2 rows, T = 5: row 0 = prompt, prompt, v3, v3, v4 (resumed across a publication);
    # row 1 = prompt, v2, observation, v4, padding
    tv = torch.tensor([[-1, -1, 3, 3, 4], [-1, 2, -1, 4, -1]])
    m = tv >= 0
    return tv, m


def test_token_staleness_golden():
    tv, m = _versions()
    s = token_staleness(tv, m, 4)  # learner at version 4: s = 4 − v on actions
    assert s.tolist() == [[0, 0, 1, 1, 0], [0, 2, 0, 0, 0]]
    assert staleness_mask(tv, m, 4, 1).tolist() == [[False, False, True, True, True],
                                                     [False, False, False, True, False]]
    assert row_policy_version(tv, m).tolist() == [3, 2]  # the oldest action token
    met = staleness_metrics(tv, m, 4, max_staleness=2)
    # action staleness 1, 1, 0, 2, 0 → max 2, mean 0.8; rows' oldest: 1 and 2 → 1.5; both rows span 2 versions
    assert float(met["staleness_max"]) == 2 and math.isclose(float(met["staleness_mean"]), 0.8, rel_tol=1e-6)
    assert float(met["staleness_row_mean"]) == 1.5 and float(met["partial_rows_frac"]) == 1.0
    assert math.isclose(float(met["staleness_at_bound_frac"]), 0.2, rel_tol=1e-6)
    assert float(met["staleness_over_bound"]) == 0


def test_staleness_refuses_unstamped_and_future_tokens():
    tv, m = _versions()
    with pytest.raises(ValueError, match="newer than the learner's version 3"):
        token_staleness(tv, m, 3)
    bad = tv.clone()
    bad[0, 2] = NO_VERSION
    with pytest.raises(ValueError, match=r"token_version: action token \[0, 2\] has no version"):
        token_staleness(bad, m, 4)
    with pytest.raises(ValueError, match="max_staleness"):
        staleness_mask(tv, m, 4, -1)


def test_a3po_alpha_and_interpolation_golden():
    tv, m = _versions()
    a = proximal_alpha(tv, m, 4)  # α = s / (s + 1): s = 0 → 0, 1 → 1/2, 2 → 2/3
    assert torch.allclose(a, torch.tensor([[0, 0, .5, .5, 0], [0, 2 / 3, 0, 0, 0]]))
    b = torch.full((2, 5), -2.0)
    c = torch.full((2, 5), -1.0, requires_grad=True)
    p = interpolated_proximal_logprobs(b, c, tv, m, 4)
    # loglinear: −2 + α·1 → fresh tokens keep the behaviour log-prob −2; 1 stale → −1.5; 2 stale → −4/3
    assert torch.allclose(p, torch.tensor([[0, 0, -1.5, -1.5, -2], [0, -2 + 2 / 3, 0, -2, 0]]))
    assert not p.requires_grad
    lin = interpolated_proximal_logprobs(b, c, tv, m, 4, method="linear")
    want = math.log(0.5 * math.exp(-2) + 0.5 * math.exp(-1))
    assert math.isclose(float(lin[0, 2]), want, rel_tol=1e-6) and float(lin[0, 4]) == -2.0


@given(st.integers(0, 6), st.integers(1, 5), st.integers(1, 8), st.integers(0, 10_000))
def test_a3po_stays_between_behaviour_and_current(version, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, T, generator=g) < 0.7
    tv = torch.where(m, torch.randint(0, version + 1, (B, T), generator=g), NO_VERSION)
    b, c = -torch.rand(B, T, generator=g) * 5, -torch.rand(B, T, generator=g) * 5
    for method in ("loglinear", "linear"):
        p = interpolated_proximal_logprobs(b, c, tv, m, version, method=method)
        lo, hi = torch.minimum(b, c), torch.maximum(b, c)
        assert bool(((p >= lo - 1e-5) & (p <= hi + 1e-5))[m].all())
        fresh = m & (tv == version)  # α = 0: exactly the behaviour log-prob
        assert torch.equal(p[fresh], b[fresh])
        assert bool((p[~m] == 0).all())


# ----------------------------------------------------------------------------- admission and the buffer


def test_capacity_is_arealS_rule_golden():
    # η = 1, batch 4, at version 0: (1 + 0 + 1)·4 − (0 + 0) = 8, capped by max_concurrent 6
    assert capacity(0, 0, 0, 1, 4, 6) == 6
    assert capacity(3, 2, 0, 1, 4, 16) == 3  # 8 − (2 + 3)
    assert capacity(0, 12, 1, 1, 4, 16) == 0  # (1 + 1 + 1)·4 = 12 reached
    assert capacity(16, 0, 9, 1, 4, 16) == 0  # max_concurrent in flight


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="async.max_staleness"):
        buffer_init(-1, 4, 8)
    with pytest.raises(ValueError, match="batch"):
        buffer_init(1, 0, 8)
    with pytest.raises(ValueError, match="async.max_concurrent"):
        buffer_init(1, 4, 0)


def test_duplicates_and_unknown_uids_are_refused():
    buf, units = admit(buffer_init(1, 2, 8), ["p0", "p1"], 0)
    buf = complete(buf, 0)
    with pytest.raises(ValueError, match="sample_uid 0: returned twice"):
        complete(buf, 0)
    with pytest.raises(KeyError, match="sample_uid 7"):
        complete(buf, 7)
    buf = evict(buf, 1, "worker returned versions staler than η")
    assert buf.evictions == ((1, "p1", "worker returned versions staler than η"),)
    check_conservation(buf)


def test_take_units_takes_exactly_the_recorded_units_once_ready():
    """A replayed consumption: the given keys, in the given order, only once all are ready."""
    buf, _ = admit(buffer_init(2, 2, 8), ["a", "b", "c"], 0)
    buf = complete(complete(buf, 0), 2)  # "a" and "c" ready, "b" running
    assert take_units(buf, ["a", "b"])[1] is None  # "b" still running: wait
    assert take_units(buf, ["a", "z"])[1] is None  # never admitted: wait (the replay's deadline reports it)
    buf, taken = take_units(buf, ["c", "a"])
    assert [u.key for u in taken] == ["c", "a"] and buf.consumed == 2 and [u.key for u in buf.units] == ["b"]
    check_conservation(buf)


def test_eta_zero_is_synchronous():
    """η = 0: exactly one batch is admitted per version, and it is trained at that version."""
    buf = buffer_init(0, 3, 100)
    for v in range(4):
        buf, new = admit(buf, list(range(10)), v)
        assert [u.version for u in new] == [v] * 3  # no more than one batch ahead
        assert admit(buf, [0], v)[1] == ()
        for u in new:
            buf = complete(buf, u.uid)
        buf, taken = take_batch(buf, v)
        assert [u.uid for u in taken] == [u.uid for u in new]


def test_the_learner_waits_for_a_unit_due_now():
    """η = 2, batch 1: three units admitted at 0; after two newer units are trained, the two old
    ones are both due by version 2 — the learner must wait rather than train a newer one first."""
    buf, _ = admit(buffer_init(2, 1, 10), ["a", "b", "c"], 0)
    buf = complete(buf, 2)
    buf, t = take_batch(buf, 0)
    assert [u.uid for u in t] == [2]
    buf, new = admit(buf, ["d"], 1)
    buf = complete(buf, new[0].uid)
    buf2, t = take_batch(buf, 1)
    assert t is None  # training d now would leave a and b (deadline 2) for one slot at version 2
    buf = complete(buf, 0)
    buf, t = take_batch(buf, 1)
    assert [u.uid for u in t] == [0]  # earliest deadline first


@given(st.integers(0, 4), st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_no_unit_is_ever_trained_staler_than_eta_under_random_event_orders(eta, batch, max_conc, seed):
    """Random interleavings of admissions, completions (any order), restarts after a lost worker,
    evictions (their prompt re-admitted) and learner steps: every consumed unit is within η of its
    admission version, the conservation law holds after every transition, nothing is consumed twice,
    and once every in-flight unit finishes the learner can always take a batch (no deadlock)."""
    import random

    rng = random.Random(seed)
    buf, version, next_key, seen, pending = buffer_init(eta, batch, max_conc), 0, 0, set(), []
    for _ in range(300):
        ev = rng.random()
        running = [u for u in buf.units if u.state == "running"]
        if ev < 0.3:
            keys = pending[:] + list(range(next_key, next_key + rng.randint(1, 4)))
            buf, new = admit(buf, keys, version)
            pending = [k for k in pending if k not in {u.key for u in new}]
            next_key = max([next_key] + [u.key + 1 for u in new])
        elif ev < 0.65 and running:
            buf = complete(buf, rng.choice(running).uid)
        elif ev < 0.7 and running:
            buf = restart(buf, rng.choice(running).uid)
        elif ev < 0.72 and buf.units:
            u = rng.choice(buf.units)
            buf = evict(buf, u.uid, "test")
            pending.append(u.key)  # the driver re-admits the prompt: nothing lost
        else:
            buf, taken = take_batch(buf, version)
            if taken is not None:
                assert len(taken) == batch
                assert all(version - u.version <= eta for u in taken), (version, taken)
                assert not {u.uid for u in taken} & seen
                seen |= {u.uid for u in taken}
                version += 1
        check_conservation(buf)
        assert buf.consumed == version * batch
        # liveness: with everything in flight finished and ≥ batch units ready, a batch can be taken
        done = buf
        for u in done.units:
            if u.state == "running":
                done = complete(done, u.uid)
        if done.ready >= batch:
            assert take_batch(done, version)[1] is not None
