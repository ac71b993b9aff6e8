

def test_the_calculator_cannot_run_away():
    """Every operand and result is bounded exactly before it is computed: nested powers that would
    hold the GIL for seconds (a thread cannot be interrupted) are refused at once."""
    import time

    import pytest
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hyperrl.envs.tools import calculate

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="would exceed 1024 bits"):
        calculate("(((9**64)**64)**64)**64")
    assert time.perf_counter() - t0 < 0.5
    assert calculate("9**64") == str(9**64) and calculate("2**64*2**64") == str(2**128)

    leaf = st.integers(0, 10**6).map(str)
    expr = st.recursive(leaf, lambda e: st.tuples(e, st.sampled_from(["**", "*", "+", "-"]), e).map(
        lambda t: f"({t[0]}{t[1]}{t[2]})"), max_leaves=12)

    @settings(max_examples=200, deadline=None)
    @given(expr)
    def bounded(text):
        start = time.perf_counter()
        try:
            out = calculate(text)
        except (ValueError, ZeroDivisionError):
            out = None
        assert time.perf_counter() - start < 0.5, text
        if out is not None and "." not in out and "e" not in out:
            assert abs(int(out)).bit_length() <= 1024

    bounded()
