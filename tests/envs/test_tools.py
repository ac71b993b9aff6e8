

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


def test_an_isolated_tool_past_its_timeout_is_killed_not_abandoned():
    import multiprocessing
    import time

    from hyperrl.envs.tools import Tool, ToolRunner

    def spin(n: int) -> str:
        """Spin.

        Args:
            n: a number
        """
        while True:
            n += 1

    def echo(n: int) -> str:
        """Echo.

        Args:
            n: a number
        """
        if n < 0:
            raise ValueError("negative")
        return str(n * 2)

    tools = {"spin": Tool.from_function(spin, timeout=0.5, isolate=True),
             "echo": Tool.from_function(echo, timeout=5.0, isolate=True)}
    runner = ToolRunner(tools)
    t0 = time.perf_counter()
    got = runner.run('<tool>{"name": "spin", "arguments": {"n": 1}}</tool>'
                     '<tool>{"name": "echo", "arguments": {"n": 21}}</tool>'
                     '<tool>{"name": "echo", "arguments": {"n": -1}}</tool>')
    assert time.perf_counter() - t0 < 5
    assert [(r.ok, r.text) for r in got] == [(False, "error: spin timed out after 0.5s"), (True, "42"),
                                             (False, "error: echo failed: RuntimeError: ValueError: negative")]
    assert multiprocessing.active_children() == []  # the spinning child was killed, nothing left running
