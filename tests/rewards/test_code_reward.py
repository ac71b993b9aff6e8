"""The ``code`` reward: programs run against their rows' unit tests in the sandbox (bubblewrap, installed by
.ci/run) — asserts and stdin/stdout pairs, as code-RL datasets carry them; different correct programs all pass."""

import json
import textwrap

import pytest

from hyperrl.config import load_config
from hyperrl.data import Sample
from hyperrl.rewards import RewardError, build_rewards
from hyperrl.rewards.code import extract_program, parse_tests

pytestmark = pytest.mark.xdist_group("sandbox")  # beside tests/foundations/test_sandbox.py's fork bomb: one worker

ASSERTS = ["assert f(1) == 4", "assert f(2) == 7", "assert f(3) == 10"]


def _rewards(tmp_path, kwargs: str = "{cpu_s: 1, wall_s: 4}"):
    y = tmp_path / "c.yaml"
    y.write_text(textwrap.dedent(f"rewards: [{{fn: code, kwargs: {kwargs}}}]"))
    return build_rewards(load_config(y, [f"--run.out_dir={tmp_path / 'run'}"]).rewards)


def _score(rs, completions, tests):
    samples = [Sample("f(1)=4, f(2)=7, f(3)=10 -> ", "", "code", {"tests": t}) for t in tests]
    comps, _, _ = rs.score([s.prompt for s in samples], completions, [[1]] * len(samples), samples)
    return comps[:, 0].tolist()


def test_different_correct_programs_all_pass_and_wrong_ones_score_their_fraction(tmp_path):
    rs = _rewards(tmp_path)
    programs = ["def f(x): return 3*x+1", "def f(x):\n    return x*3+1", "f = lambda x: 1 + 3 * x",
                "def f(x): return 3*x", "def f(x): return 4 if x == 1 else 7", "def f(x) return", "import os"]
    # hand-derived: 3x+1 passes 3/3 three ways; 3x passes none; the lookup passes f(1), f(2): 2/3;
    # a syntax error and a program without f pass none
    assert _score(rs, programs, [ASSERTS] * len(programs)) == [1.0, 1.0, 1.0, 0.0, pytest.approx(2 / 3), 0.0, 0.0]


def test_a_fenced_block_is_the_program_and_a_hanging_one_scores_zero(tmp_path):
    rs = _rewards(tmp_path)
    fenced = "Here you go:\n```python\ndef f(x):\n    return 3*x + 1\n```\nDone."
    hang = "def f(x):\n    while True: pass"
    assert _score(rs, [fenced, hang], [ASSERTS, ASSERTS]) == [1.0, 0.0]
    assert extract_program(fenced) == "def f(x):\n    return 3*x + 1"
    assert extract_program("  x = 1  ") == "x = 1"


def test_stdin_stdout_pairs_and_the_all_pass_mode(tmp_path):
    io = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})  # verl's input_output, a JSON string
    right = "a, b = map(int, input().split())\nprint(a + b)"
    half = "a, b = map(int, input().split())\nprint(3)"
    assert _score(_rewards(tmp_path), [right, half], [io, io]) == [1.0, 0.5]
    strict = _rewards(tmp_path, "{all_pass: true, cpu_s: 1, wall_s: 4}")
    assert _score(strict, [right, half], [io, io]) == [1.0, 0.0]


def test_rows_without_tests_are_named(tmp_path):
    rs = _rewards(tmp_path)
    with pytest.raises(RewardError, match=r"code reward: row 1: no tests — a row needs `tests`"):
        _score(rs, ["def f(x): return 1", "def f(x): return 1"], [ASSERTS, []])
    with pytest.raises(RewardError, match=r"row 0: tests has 2 inputs and 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["1"]}, 0)
    assert parse_tests("assert True") == ("asserts", ["assert True"])


def test_rows_run_concurrently_give_the_values_of_one_at_a_time(tmp_path):
    programs = ["def f(x): return 3*x+1", "def f(x): return 3*x", "def f(x):\n    while True: pass",
                "import os\nwhile True:\n    os.fork()", "def f(x): return 4 if x == 1 else 7"] * 2
    serial = _score(_rewards(tmp_path, "{cpu_s: 1, wall_s: 4, workers: 1}"), programs, [ASSERTS] * len(programs))
    pooled = _score(_rewards(tmp_path, "{cpu_s: 1, wall_s: 4, workers: 4}"), programs, [ASSERTS] * len(programs))
    # a fork bomb in one slot does not starve the others (each slot its own uid): 3x+1 still passes beside it
    assert serial == pooled == [1.0, 0.0, 0.0, 0.0, pytest.approx(2 / 3)] * 2


def test_the_postfix_task_is_judged_by_running_its_answers_many_programs_right():
    """configs/code.yaml's task: every correct program passes all of a sample's tests, whatever its form; nearer
    programs pass more (the graded tests) and a constant passes none; a program that does not compile is failed
    without a run."""
    from hyperrl.data.tasks import TASKS
    from hyperrl.rewards.code import code_reward, compiles
    from hyperrl.tokenizer import char_tokenizer

    task = TASKS.build("postfix")(char_tokenizer("0123456789x+-*()= "), 0)
    s = task._sample((3, 1))  # 3·x + 1
    assert s.prompt == "x3*1+=" and s.answer == "3*x+1"
    fn = code_reward(prefix="f = lambda x: ", workers=2, cpu_s=1, wall_s=3)
    right = ["3*x+1", "x*3+1", "1+3*x", "x+x+x+1", "(x*3)+1", "int(3*x+1)"]
    wrong = ["3*x", "x*5", "x", "7", "3*x+", "y"]
    got = fn([s.prompt] * 12, right + wrong, tests=[s.extra["tests"]] * 12)
    assert got[:6] == [1.0] * 6 and all(g < 1.0 for g in got[6:])
    # 13 tests: increasing, then at x = 10, 10⁴, 10⁷ within 10×, 2×, 10 %, exact. 3·x is within 10 % but for
    # x = 10 (30 vs 31 is; all three are): 1 + 3 + 3 + 3 = 10; 5·x: 1 + 3 + 3 = 7; x: 1 + 3 (x is within 10×, not
    # 2×) = 4; a constant is increasing nowhere and within 10× of one value at most (7 of 31): 1.
    assert got[6:10] == [10 / 13, 7 / 13, 4 / 13, 1 / 13]
    assert got[10] == got[11] == 0.0 and not compiles("f = lambda x: 3*x+") and compiles("f = lambda x: y")
    t = task._sample((2, -3))  # 2·x − 3
    assert t.prompt == "x2*3-=" and t.answer == "2*x-3" and task._sample((4, 0)).prompt == "x4*="
    assert fn([t.prompt] * 3, ["x*2-3", "x+x-3", "2*x+3"], tests=[t.extra["tests"]] * 3)[:2] == [1.0, 1.0]


def test_a_verdict_the_machine_may_have_caused_is_not_cached():
    """A run that hit its deadline is scored 0 but not remembered (a quieter moment may finish it); a settled one
    (ok, error) is."""
    from hyperrl.rewards.code import _CACHE, code_reward

    fn = code_reward(wall_s=1, cpu_s=1, workers=1)
    before = len(_CACHE.data)
    assert fn(["p"], ["while True:\n    pass"], tests=[["assert True"]]) == [0.0]
    assert len(_CACHE.data) == before
    assert fn(["p"], ["x = 1"], tests=[["assert x == 1"]]) == [1.0]
    assert len(_CACHE.data) == before + 1


@pytest.mark.slow
def test_the_code_task_rises_from_random_weights(tmp_path):
    """configs/code.yaml for 100 steps (the whole run: benchmarks/seeds.py, RESULTS.md): from random weights the
    held-out greedy answers go from passing nothing to passing a good share of the graded tests (0 → 0.28 at
    step 100 on seed 0; 0.49 in the draw before the engine's own decode step changed the sampled tokens' rounding —
    over seeds this task's early curve spreads widely: passed 0–0.77 at step 500, RESULTS.md), every program judged
    in the sandbox."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", "--config", "configs/code.yaml",
                          "--run.steps=100", f"--run.out_dir={out}", "--run.export=false"],
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 100]
    assert evals[0]["eval_reward_tests_mean"] < 0.05 and evals[1]["eval_reward_tests_mean"] > 0.2
