"""AsyncTrainer with a multi-turn environment (the built-in calculator): an episode group is the unit of
admission, each turn a keyed request. η = 0 equals the SyncTrainer bit for bit; at η > 0 every trained
token is within η, a publication interrupts a turn mid-generation and the turn resumes from its exact
partial tokens; a dead worker loses only the turn in flight; an environment that raises fails the step
naming it."""

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.envs import CalculatorCopyEnv
from hyperrl.loop.trainer import AsyncTrainer
from hyperrl.rollout import LocalWorker, WorkerDied
from hyperrl.rollout.requests import call_key
from hyperrl.rollout.workers import WorkerError
from tests.async_helpers import assert_trained_once_within_eta
from tests.loop.test_async_trainer import _assert_same_run, _Recording, _restart_worker


class _Eager(CalculatorCopyEnv):
    """The calculator environment where every response before the last allowed call is a call (the
    random policy seldom begins with ``?``): every episode runs ``max_calls + 1`` turns, with observations."""

    def _call(self, action):
        return super()._call(action if action.startswith("?") else "?" + action)


def _cfg(tmp_path, *extra):
    return load_config("configs/calculator.yaml", [f"--run.out_dir={tmp_path}", "--run.eval_every=0",
                                                   "--rollout.prompts_per_step=4", "--rollout.n=4",
                                                   "--rollout.max_turns=3", "--env.max_calls=2", *extra])


def _build(cfg, **kw):
    """A trainer whose episodes are :class:`_Eager`'s."""
    tr = build_trainer(cfg, **kw)
    tr.generator.driver.env = lambda: _Eager(format="compact", max_calls=2)
    return tr


def _segments(act: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) of each run of action tokens in one row."""
    out, start = [], None
    for i, a in enumerate(act.tolist() + [False]):
        if a and start is None:
            start = i
        elif not a and start is not None:
            out.append((start, i))
            start = None
    return out


def test_eta_zero_is_the_sync_trainer_bit_for_bit_on_the_calculator_environment(tmp_path):
    sync = _build(_cfg(tmp_path / "s"))
    asyn = _build(_cfg(tmp_path / "a"), trainer=AsyncTrainer, max_staleness=0)
    try:
        ms, ma = [sync.step() for _ in range(4)], [asyn.step() for _ in range(4)]
    finally:
        asyn.close()
    _assert_same_run(sync, asyn, ms, ma)
    assert ms[0]["tool_call_rate"] == 1.0  # every episode called the calculator: three turns, two observations


@pytest.mark.parametrize("eta", [1, 2])
def test_turns_resume_across_publications_within_eta_and_lose_nothing(tmp_path, eta):
    # the first call at version 1 is held before its 5th decode step until the next publication
    # interrupts it: one turn of one episode is cut mid-generation whatever the machine's load
    tr = _build(_cfg(tmp_path, "--rollout.max_new_tokens=8"), trainer=_Recording, max_staleness=eta)
    _restart_worker(tr, "hold")
    try:
        ms = [tr.step() for _ in range(6)]
    finally:
        tr.close()
    assert_trained_once_within_eta(tr.trained, 6 * 4 * 4, eta)
    cut = False  # one turn (a contiguous run of actions) sampled under two versions: resumed mid-call
    for _, _, _, tv, act in tr.trained:
        for row in range(tv.shape[0]):
            cut |= any(len(set(tv[row, a:b].tolist())) > 1 for a, b in _segments(act[row]))
    assert cut, "no turn was resumed across a publication"
    assert max(m["staleness_max"] for m in ms) <= eta and ms[-1]["async_evicted"] == 0
    b = tr.collector.queue.buffer
    assert b.admitted == b.consumed + b.evicted + b.in_flight + b.ready
    assert not tr.generator.driver.turns or b.in_flight  # no turn left behind by a finished unit


def test_a_gated_multi_turn_run_reproduces_bit_for_bit(tmp_path):
    """Gated: each batch's turns come from one version, taken in lockstep — the same turn batches
    whatever order the environments' steps finished in, so two runs train the same weights."""
    runs = []
    for k in range(2):
        tr = _build(_cfg(tmp_path / str(k), "--async.schedule=gated"), trainer=AsyncTrainer, max_staleness=1)
        try:
            runs.append(([tr.step() for _ in range(4)], tr))
        finally:
            tr.close()
    (ma, a), (mb, b) = runs
    assert [m["loss_policy"] for m in ma] == [m["loss_policy"] for m in mb]
    assert max(m["staleness_max"] for m in ma) == 1  # batches trained one version after they were generated
    assert all(torch.equal(p, q) for p, q in zip(a.policy.parameters(), b.policy.parameters()))


def test_a_resumed_gated_multi_turn_run_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    """Gated, η = 1, checkpoint after step 2: batch 2's episodes (finished at version 1) travel in the checkpoint as
    rows; batch 3's run again from their first turn under the resumed weights — the same weights as the
    uninterrupted run at the end."""
    a = _build(_cfg(tmp_path / "a", "--async.schedule=gated"), trainer=AsyncTrainer, max_staleness=1)
    try:
        ma = [a.step() for _ in range(4)]
    finally:
        a.close()
    b = _build(_cfg(tmp_path / "b", "--async.schedule=gated"), trainer=AsyncTrainer, max_staleness=1)
    try:
        mb = [b.step() for _ in range(2)]
        b.save()
    finally:
        b.close()
    c = _build(_cfg(tmp_path / "b", "--async.schedule=gated"), trainer=AsyncTrainer, max_staleness=1)
    try:
        assert c.resume() and c.collector.queue.buffer.ready == 4  # batch 2's 4 groups, with their rows
        mb += [c.step() for _ in range(2)]
    finally:
        c.close()
    assert [m["loss_policy"] for m in ma] == [m["loss_policy"] for m in mb]
    assert all(torch.equal(p, q) for p, q in zip(a.policy.parameters(), c.policy.parameters()))


class _Restartable(LocalWorker):
    """A worker whose process can "die": its engine call raises WorkerDied once (the requests it held
    come back to nobody); restart() brings it back serving the same engine."""

    def __init__(self, engine, die_on_call: int):
        super().__init__(engine)
        self.calls, self.die_on_call, self.restarted = 0, die_on_call, 0

    def generate_requests(self, requests, sampling, stop_after=-1):
        self.calls += 1
        out = super().generate_requests(requests, sampling, stop_after)
        if self.calls == self.die_on_call:
            self.lost = [q.uid for q in requests]
            raise WorkerDied(self.name, "killed by the test")
        return out

    def restart(self):
        self.restarted += 1


def test_a_dead_worker_loses_only_the_turn_in_flight(tmp_path):
    """The episodes' environments live in the learner's process: a worker that dies mid-call loses the
    turns it held, which wait again unchanged (same keyed requests) — their episodes go on, no episode
    starts again, and the run equals one that lost nothing (η = 0: the same weights)."""
    ref = _build(_cfg(tmp_path / "r"))
    tr = _build(_cfg(tmp_path / "d"), trainer=AsyncTrainer, max_staleness=0)
    c = tr.collector
    c.stop_workers()
    c.workers = [_Restartable(c.engine, die_on_call=2)]  # step 0's second turn (η = 0: turns in lockstep)
    c.start_workers()
    try:
        mr, md = [ref.step() for _ in range(3)], [tr.step() for _ in range(3)]
    finally:
        tr.close()
    assert c.workers[0].restarted == 1 and c.restarts == 1
    assert sorted(c.workers[0].lost) == sorted(call_key(u, 1) for u in range(16))  # mid-episode turns, nothing else
    assert md[-1]["async_restarts"] == 1
    _assert_same_run(ref, tr, mr, md)


class _Broken(CalculatorCopyEnv):
    def step(self, action):
        raise KeyError("sandbox gone")


def test_an_environment_that_raises_fails_the_step_naming_it(tmp_path):
    tr = build_trainer(_cfg(tmp_path), trainer=AsyncTrainer, max_staleness=1)
    tr.generator.driver.env = lambda: _Broken(format="compact")
    try:
        with pytest.raises(WorkerError, match="environment _Broken: step of episode .* KeyError"):
            tr.step()
    finally:
        tr.close()
