"""Scoring off the trainer's thread (issue 50, item 1): every reward style on a thread pool, in worker processes or
on the event loop gives the values of serial scoring, in row order; deadlines off the main thread; a worker that
dies or hangs is killed and restarted, the call named; retries; on_error: abstain counted; bad set-ups named at
load; no worker process outlives the trainer."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperrl.config.schema import RewardSpec
from hyperrl.data import Sample
from hyperrl.rewards import REWARDS, RewardError, build_rewards, check_rewards
from hyperrl.rewards.scoring import Ran

pytestmark = pytest.mark.xdist_group("reward_pools")  # worker processes: kept off the other tests' cores

FNS = '''
import asyncio, os, time
from pathlib import Path

def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    print("a reward that prints to stdout")  # never into the worker's protocol
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

def trl_score(prompts, completions, answer, **kw):
    return [len(c) / 7 + (1.0 if c == a else 0.0) for c, a in zip(completions, answer)]

def mine(response, sample):
    return sum(map(ord, response)) % 13 / 13

def faulty(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "raise":
        raise ValueError("cannot score " + solution_str)
    return float(solution_str == ground_truth)

def flaky(data_source, solution_str, ground_truth, extra_info=None, marks=""):
    mark = Path(marks) / solution_str  # fails on each row's first call: a transient failure
    if not mark.exists():
        mark.write_text("seen")
        raise ConnectionError("transient")
    return 1.0

def named(data_source, solution_str, ground_truth, extra_info=None):
    from hyperrl.rewards import RewardError
    if solution_str == "y":
        raise RewardError("this row has no tests", row=0)  # row 0 of its call: the call's one row
    return 1.0

def exits(data_source, solution_str, ground_truth, extra_info=None):
    raise SystemExit(3)

async def slow_async(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(10.0 if solution_str == "hang" else 0.3)
    return float(solution_str == ground_truth)

def own_alarm(data_source, solution_str, ground_truth, extra_info=None):
    import signal
    if solution_str == "install":  # a reward with its own alarm handler, left installed
        def mine(signum, frame):
            raise TimeoutError("the reward's own alarm")
        signal.signal(signal.SIGALRM, mine)
    if solution_str == "hang":
        time.sleep(600)
    return 1.0

def pids(prompts, completions, **kw):
    return [float(os.getpid()) for _ in completions]
'''


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    f = tmp_path_factory.mktemp("rewards") / "fns.py"
    f.write_text(FNS)
    return f


def _set(f, *specs):
    return build_rewards([RewardSpec(**{**s, "fn": f"{f}:{s['fn']}"}) for s in specs])


def _three(f, **pool):
    return _set(f, dict(fn="verl_score", style="verl", **pool), dict(fn="trl_score", style="trl", **pool),
                dict(fn="mine", style="hyperrl", **pool))


@pytest.fixture(scope="module")
def three_ways(fns):
    sets = {"serial": _three(fns), "thread": _three(fns, workers=4),
            "process": _three(fns, workers=2, pool="process"), "trl_chunks": _three(fns, workers=3, batch=2)}
    yield sets
    for s in sets.values():
        s.close()


_SAMPLE = [Sample("1+2=", "3", "a", {}), Sample("x", "ok", "b", {}), Sample("4+4=", "8", "c", {"extra_info": {"k": 1}})]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.sampled_from(["3", "ok", "8", "", "no", "12", "ok!"]), min_size=1, max_size=12))
def test_pooled_scoring_equals_serial_scoring_bit_for_bit(three_ways, texts):
    samples = [_SAMPLE[i % 3] for i in range(len(texts))]
    prompts, ids = [s.prompt for s in samples], [[i] for i in range(len(texts))]
    want = three_ways["serial"].score(prompts, texts, ids, samples)
    for name in ("thread", "process", "trl_chunks"):
        got = three_ways[name].score(prompts, texts, ids, samples)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        assert got[2] == want[2], name  # the verl dict's extras: the same means
    # golden, by hand: "3" on row 0 (answer "3") scores verl 1, trl 1/7 + 1; "" scores 0 and 0
    if texts[0] == "3":
        assert want[0][0, :2].tolist() == [1.0, pytest.approx(1 / 7 + 1)]


def test_a_process_worker_past_its_deadline_is_killed_and_restarted_and_the_call_named(fns):
    rs = _set(fns, dict(fn="faulty", style="verl", workers=2, pool="process", timeout_s=1.0))
    try:
        runner = rs.runners[0]
        before = {w.proc.pid for w in runner.every}
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match=r"reward 'faulty' did not return within rewards\[\].timeout_s=1.0 s; "
                                              r"its worker process was killed \(and restarted\) — batch row 1"):
            rs.score(["p"] * 3, ["3", "hang", "8"], [[1]] * 3, _SAMPLE)
        assert time.perf_counter() - t0 < 10
        comps, app, _ = rs.score(["p"] * 3, ["3", "x", "8"], [[1]] * 3, _SAMPLE)  # the pool serves again
        assert comps[:, 0].tolist() == [1.0, 0.0, 1.0] and app.all()
        killed = [w for w in runner.every if w.proc.pid in before and not w.alive]
        assert len(killed) == 1 and runner.restarts == 1 and killed[0].proc.returncode == -signal.SIGKILL
    finally:
        rs.close()
    assert all(not w.alive for w in runner.every)  # close ends every worker


def test_a_dying_worker_fails_its_call_and_abstain_counts_it(fns):
    rs = _set(fns, dict(fn="faulty", style="verl", workers=2, pool="process", on_error="abstain", retries=1))
    try:
        with pytest.warns(RuntimeWarning, match=r"reward 'faulty' failed: its worker process died \(exit code 3; "
                                                r"restarted\).*on_error: abstain"):
            comps, app, m = rs.score(["p"] * 3, ["3", "die", "raise"], [[1]] * 3, _SAMPLE)
        assert app[:, 0].tolist() == [True, False, False] and comps[0, 0] == 1.0
        assert m["reward_faulty_failed"] == 2.0 and m["reward_faulty_retries"] == 2.0  # each retried once
        comps, app, m = rs.score(["p"] * 3, ["3", "ok", "8"], [[1]] * 3, _SAMPLE)
        assert app.all() and m["reward_faulty_failed"] == 0.0
    finally:
        rs.close()
    rs = _set(fns, dict(fn="faulty", style="verl", workers=1, pool="process"))
    try:
        with pytest.raises(RewardError, match=r"reward 'faulty' failed: its worker process died \(exit code 3; "
                                              r"restarted\) .*— batch row 2"):
            rs.score(["p"] * 3, ["3", "ok", "die"], [[1]] * 3, _SAMPLE)
    finally:
        rs.close()


def test_transient_failures_are_retried_within_the_bound(fns, tmp_path):
    spec = dict(fn="flaky", style="verl", workers=3, kwargs={"marks": str(tmp_path)})
    rs = _set(fns, {**spec, "retries": 2})
    comps, app, m = rs.score(["p"] * 3, ["a", "b", "c"], [[1]] * 3, _SAMPLE)
    assert comps[:, 0].tolist() == [1.0, 1.0, 1.0] and m["reward_flaky_retries"] == 3.0
    rs.close()
    rs = _set(fns, spec)  # no retries: the first failure is the step's
    with pytest.raises(RewardError, match=r"reward 'flaky' raised ConnectionError: transient — batch row 0"):
        rs.score(["p"], ["d"], [[1]], _SAMPLE[:1])
    rs.close()


@pytest.mark.parametrize("pool", [dict(), dict(workers=2), dict(workers=2, pool="process")])
def test_a_reward_naming_bad_input_is_never_retried_nor_abstained(fns, pool):
    rs = _set(fns, dict(fn="named", style="verl", retries=3, on_error="abstain", **pool))
    try:
        t0 = time.perf_counter()
        with pytest.raises(RewardError, match=r"this row has no tests — batch row 1"):
            rs.score(["p"] * 2, ["x", "y"], [[1]] * 2, [_SAMPLE[0], _SAMPLE[1]])
        assert time.perf_counter() - t0 < 2  # no back-off: not retried
    finally:
        rs.close()


def test_async_rewards_run_concurrently_on_one_loop_with_a_bound_and_a_deadline(fns):
    rs = _set(fns, dict(fn="slow_async", style="verl", workers=16, timeout_s=2.0))
    n = 16
    t0 = time.perf_counter()
    comps, app, _ = rs.score(["p"] * n, ["3"] * n, [[1]] * n, [_SAMPLE[0]] * n)
    took = time.perf_counter() - t0
    assert comps[:, 0].tolist() == [1.0] * n and took < 0.3 * n / 2  # serially: 4.8 s; 16 at once ≈ 0.3 s
    with pytest.raises(RewardError, match=r"reward 'slow_async' did not return within rewards\[\].timeout_s=2.0 s; "
                                          r"it was cancelled — batch row 1"):
        rs.score(["p"] * 2, ["3", "hang"], [[1]] * 2, [_SAMPLE[0]] * 2)
    bounded = _set(fns, dict(fn="slow_async", style="verl", workers=2))
    t0 = time.perf_counter()
    bounded.score(["p"] * 4, ["3"] * 4, [[1]] * 4, [_SAMPLE[0]] * 4)
    assert time.perf_counter() - t0 >= 0.6  # two at a time: two rounds of 0.3 s


def test_a_thread_pool_reports_a_call_past_its_deadline(fns):
    rs = _set(fns, dict(fn="faulty", style="verl", workers=2, timeout_s=0.5))
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward 'faulty' did not return within rewards\[\].timeout_s=0.5 s \(a "
                                          r"thread cannot be stopped.*use pool: process.* — batch row 0"):
        rs.score(["p"], ["hang"], [[1]], _SAMPLE[:1])
    assert time.perf_counter() - t0 < 3
    rs.close()


def test_what_a_worker_process_cannot_rebuild_is_named_at_load(fns):
    def local_reward(response, sample):
        return 1.0

    local_reward.__module__ = "__main__"  # as a function defined in a user's script
    REWARDS.register("from_main")(local_reward)
    try:
        with pytest.raises(RewardError, match=r"rewards\[0\]: pool: process rebuilds the reward in a worker process, "
                                              r"but 'from_main' is defined in __main__.*fn: path/to/file.py:name.*"
                                              r"pool: thread"):
            check_rewards([RewardSpec(fn="from_main", workers=2, pool="process")])
        check_rewards([RewardSpec(fn="from_main", workers=2)])  # threads share the trainer's memory: fine
    finally:
        REWARDS.remove("from_main")
    with pytest.raises(RewardError, match=r"rewards\[0\].pool: 'inline' is not a pool; use thread .* or process"):
        check_rewards([RewardSpec(fn=f"{fns}:mine", style="hyperrl", workers=2, pool="inline")])
    bad = fns.parent / "bad_import.py"
    bad.write_text("import os\nif os.environ.get('HYPERRL_TEST_PARENT') != str(os.getpid()):\n"
                   "    raise ImportError('only importable here')\n"
                   "def r(response, sample):\n    return 1.0\n")
    os.environ["HYPERRL_TEST_PARENT"] = str(os.getpid())
    try:
        with pytest.raises(RewardError, match=r"reward 'r': its worker process could not rebuild it: RewardError: "
                                              r".*only importable here"):
            _set(bad, dict(fn="r", style="hyperrl", workers=1, pool="process"))
    finally:
        del os.environ["HYPERRL_TEST_PARENT"]


def test_registered_factories_run_in_worker_processes(tmp_path):
    """A factory (here the code reward) is rebuilt in each worker from its name's function and hyperparameters."""
    rs = build_rewards([RewardSpec(fn="math_verify", workers=2, pool="process")])
    try:
        samples = [Sample("q", "1/2", "a", {}), Sample("q", "3", "b", {})]
        comps, app, _ = rs.score(["q", "q"], ["The answer is $\\frac{1}{2}$", "it is 4"], [[1], [2]], samples)
        assert comps[:, 0].tolist() == [1.0, 0.0]
        assert rs.rewards[0].fn is None  # built in the workers only
    finally:
        rs.close()


def test_no_worker_process_outlives_a_killed_trainer(fns, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time
        from hyperrl.config.schema import RewardSpec
        from hyperrl.rewards import build_rewards
        rs = build_rewards([RewardSpec(fn="{fns}:pids", style="trl", workers=2, pool="process")])
        print(json.dumps([w.proc.pid for w in rs.runners[0].every]), flush=True)
        time.sleep(600)
    """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(p.stdout.readline())
        assert all(os.path.exists(f"/proc/{q}") for q in pids)
        p.kill()  # SIGKILL: no cleanup runs in the trainer
        p.wait()
        deadline = time.time() + 5
        while time.time() < deadline and any(_running(q) for q in pids):
            time.sleep(0.1)
        assert not any(_running(q) for q in pids), "a reward worker outlived the trainer"
    finally:
        p.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_logs_the_same_metrics_with_one_or_four_workers(fns, tmp_path):
    """The loop's view: two steps of the default job scored inline, by 4 threads and by 2 worker processes — every
    logged number but the timings is equal."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    runs = {}
    for name, extra in {"one": "workers: 1", "four": "workers: 4", "processes": "workers: 2, pool: process"}.items():
        rewards = (f"[{{fn: '{fns}:verl_score', style: verl, {extra}}}, {{fn: '{fns}:trl_score', style: trl, "
                   f"{extra}}}]")
        cfg = load_config(None, [f"--rewards={rewards}", "--rollout.prompts_per_step=4", "--rollout.n=4",
                                 "--run.eval_every=0", f"--run.out_dir={tmp_path / name}", "--run.threads=1"])
        tr = build_trainer(cfg)
        try:
            runs[name] = [{k: v for k, v in tr.step().items() if not k.startswith("time_") and not k.endswith("_per_s")}
                          for _ in range(2)]
        finally:
            tr.close()
    assert runs["one"] == runs["four"] == runs["processes"]
    assert {"reward_verl_score_mean", "reward_verl_score_length_mean", "reward_trl_score_mean"} <= set(runs["one"][0])


def test_an_async_run_scores_each_group_as_it_finishes_with_the_same_metrics(fns, tmp_path):
    """Gated async (η = 1): pooled rewards start as each group is ready, hidden behind generation — every logged
    number but the timings (the queue's gauges among them) and the overlap report equals scoring the batch inline
    at the step."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    runs = {}
    for name, extra in {"inline": "", "pooled": ", workers: 2"}.items():
        rewards = f"[{{fn: '{fns}:verl_score', style: verl{extra}}}, {{fn: '{fns}:trl_score', style: trl{extra}}}]"
        cfg = load_config(None, [f"--rewards={rewards}", "--rollout.prompts_per_step=4", "--rollout.n=4",
                                 "--async.max_staleness=1", "--async.schedule=gated", "--run.eval_every=0",
                                 f"--run.out_dir={tmp_path / name}", "--run.threads=1"])
        tr = build_trainer(cfg)
        try:
            runs[name] = [tr.step() for _ in range(3)]
        finally:
            tr.close()
    assert tr.scorer.overlaps
    for a, b in zip(runs["inline"], runs["pooled"]):
        assert "reward_hidden_frac" not in a and 0.0 <= b.pop("reward_hidden_frac") <= 1.0
        assert b.pop("reward_latency_s") >= 0.0
        # the queue's gauges say how far the background generation had got when the step logged: timing, not data
        keep = [k for k in a if not k.startswith("time_") and not k.endswith("_per_s")
                and k not in ("async_admitted", "async_in_flight", "async_ready")]
        assert {k: a[k] for k in keep} == {k: b[k] for k in keep}


def test_stuck_threads_are_replaced_and_odd_failures_are_outcomes_not_hangs(fns):
    """A thread stuck past its deadline gets a replacement (the calls queued behind it still run); a reward that
    calls sys.exit, and arguments a worker process cannot be sent, fail their call — never a hung step."""
    rs = _set(fns, dict(fn="faulty", style="verl", workers=1, timeout_s=0.5, on_error="abstain"))
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="did not return within"):
        comps, app, m = rs.score(["p"] * 3, ["hang", "hang", "3"], [[1]] * 3, [_SAMPLE[0]] * 3)
    assert app[:, 0].tolist() == [False, False, True] and comps[2, 0] == 1.0 and time.perf_counter() - t0 < 5
    rs.close()
    rs = _set(fns, dict(fn="exits", style="verl", workers=2))
    with pytest.raises(RewardError, match=r"reward 'exits' raised SystemExit: 3 — batch row 0"):
        rs.score(["p"], ["x"], [[1]], _SAMPLE[:1])
    rs.close()
    rs = _set(fns, dict(fn="verl_score", style="verl", workers=1, pool="process"))
    try:
        odd = Sample("p", "3", "a", {"extra_info": lambda: 0})  # a lambda cannot be pickled
        with pytest.raises(RewardError, match=r"raised AttributeError while its arguments were sent to a worker "
                                              r"process"):
            rs.score(["p"], ["3"], [[1]], [odd])
        assert rs.score(["p"], ["3"], [[1]], _SAMPLE[:1])[0][0, 0] == 1.0  # the worker serves on
    finally:
        rs.close()


def test_inline_calls_made_in_one_pass_give_what_one_call_at_a_time_gives(fns):
    # an inline reward's calls are made in one pass (scoring.Ran, InlineRunner.run_all), each within its deadline; a
    # one-thread pool makes them one at a time through the runners' futures: the same values, failures and errors
    texts = ["3", "raise", "8", "hang", "raise", "no"]
    samples = [_SAMPLE[i % 3] for i in range(6)]
    args = (["p"] * 6, texts, [[1]] * 6, samples)
    spec = dict(fn="faulty", style="verl", on_error="abstain", timeout_s=0.5)
    fast, slow = _set(fns, spec, dict(fn="mine", style="hyperrl")), _set(fns, {**spec, "workers": 1},
                                                                          dict(fn="mine", style="hyperrl", workers=1))
    try:
        assert isinstance(fast.submit(*args[:2], [[1]] * 2, samples[:2]).parts[0][3], Ran)
        with pytest.warns(RuntimeWarning, match="raised ValueError: cannot score raise"):
            a = fast.score(*args)
        with pytest.warns(RuntimeWarning, match="raised ValueError: cannot score raise"):
            b = slow.score(*args)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
        # by hand: rows 1 and 4 raised, row 3 ran past its deadline (abstained); row 0 ("3", answer "3") and row 2
        # ("8", answer "8") score 1, row 5 0 — the rows after the stopped call are scored
        assert a[1][:, 0].tolist() == [True, False, True, False, False, True]
        assert a[0][:, 0].tolist() == [1, 0, 1, 0, 0, 0] and a[2]["reward_faulty_failed"] == 3.0
        quick = (args[0], [t if t != "hang" else "no" for t in texts], *args[2:])  # no call waits out a deadline
        for rs in (_set(fns, dict(fn="faulty", style="verl")), _set(fns, dict(fn="faulty", style="verl", workers=1))):
            with pytest.raises(RewardError, match=r"reward 'faulty' raised ValueError: cannot score raise — batch "
                               r"row 1"):  # on_error: raise names the first failed row either way
                rs.score(*quick)
            rs.close()
    finally:
        fast.close()
        slow.close()


def test_a_deadline_as_a_call_returns_is_its_timeout_and_no_row_shifts(monkeypatch):
    # InlineRunner.run_all: the alarm delivered after the call returned, before the timer is cancelled (simulated:
    # the cancelling setitimer raises the deadline after the "race" row) — that call is a timeout, one value a call
    import hyperrl.rewards.runners as runners

    seen = []

    def fn(text):
        seen.append(text)
        return float(len(text))

    real = runners.signal.setitimer

    def setitimer(which, seconds, *rest):
        out = real(which, seconds, *rest)
        if seconds == 0 and seen and seen[-1] == "race" and len(seen) not in fired:
            fired.add(len(seen))
            raise runners._Deadline()
        return out

    fired = set()
    monkeypatch.setattr(runners.signal, "setitimer", setitimer)
    run = runners.InlineRunner(fn, workers=0, timeout_s=30)
    values, failed = run.run_all([runners.Call((i,), (t,)) for i, t in enumerate(["a", "race", "ccc", "dddd"])])
    assert values == [1.0, None, 3.0, 4.0] and list(failed) == [1] and failed[1].kind == "timeout"


def test_a_reward_that_takes_the_alarm_signal_still_meets_its_deadline(fns):
    # a reward installing its own SIGALRM handler (and leaving it) must not turn the next call's deadline into its
    # exception: each call runs under the deadline's handler, as one call at a time did
    rs = _set(fns, dict(fn="own_alarm", style="verl", on_error="abstain", timeout_s=0.5))
    try:
        with pytest.warns(RuntimeWarning, match=r"did not return within rewards\[\].timeout_s=0.5 s"):
            comps, app, m = rs.score(["p"] * 3, ["install", "hang", "x"], [[1]] * 3, _SAMPLE)
        assert app[:, 0].tolist() == [True, False, True] and m["reward_own_alarm_failed"] == 1.0
    finally:
        rs.close()
