"""Agent programs in the AsyncTrainer (configs/calculator_agent.yaml): a prompt's n episodes are the unit of
admission, run as one round that is never paused; their gateway calls are requests on the rollout
workers' queue, which a publication interrupts and resumes under the new weights. Every trained token
within η, every episode's rows trained once, a call cut mid-generation carries two versions."""

from __future__ import annotations

import time

import pytest

from hyperrl.agents import AgentError
from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.loop.trainer import AsyncTrainer
from tests.async_helpers import assert_trained_once_within_eta
from tests.loop.test_async_episodes import _segments
from tests.loop.test_async_trainer import _Recording, _restart_worker

CFG = "configs/calculator_agent.yaml"


class _Updating(_Recording):
    """Records, besides, the version whose batch the learner is training on (its publication comes next)."""

    def collect(self, timer):
        out = super().collect(timer)
        self.updating_from = self.version
        return out


def _trainer(tmp_path, eta, *extra, trainer=_Updating):
    cfg = load_config(CFG, [f"--run.out_dir={tmp_path}", "--model.hidden=32", "--model.intermediate=64",
                            "--run.threads=1", "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.eval_every=0",
                            "--rollout.max_new_tokens=8", *extra])
    return build_trainer(cfg, trainer=trainer, max_staleness=eta)


def _isolate(isolate: bool) -> list[str]:
    """The program in the config's agent processes (two: a prompt group's episodes split between them), or in
    the trainer's process (one runner: ``env.workers`` counts agent processes)."""
    return ["--env.isolate=true"] if isolate else ["--env.isolate=false", "--env.workers=1"]


SLOW_AGENT = """
import asyncio


async def solve(sample, client):
    # three turns of one conversation, each after a tool's wait of 40-200 ms: calls keep arriving while the learner
    # trains
    messages = [{"role": "user", "content": sample.prompt}]
    for turn in range(3):
        r = await client.chat.completions.create(model="hyperrl-policy", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await asyncio.sleep(0.04 * (1 + len(r.choices[0].message.content or "") % 5))
    return float(len(r.choices[0].message.content or "") % 2)
"""


@pytest.mark.parametrize("isolate", [True, False])
def test_agent_episodes_train_within_eta_once_and_calls_resume_across_publications(tmp_path, isolate):
    (tmp_path / "slow_agent.py").write_text(SLOW_AGENT)
    tr = _trainer(tmp_path, 2, *_isolate(isolate), f"--env.program={tmp_path}/slow_agent.py:solve",
                  "--env.tool_format=none", "--rollout.max_episode_tokens=128")
    # the first call at version ≥ 1 that starts while the learner trains (its publication comes next) is held before
    # its 2nd decode step until that publication interrupts it (an agent's call may be one request: held early, it
    # is still generating; held while the learner waits for a batch, it would hold up the units it waits for)
    eng = _restart_worker(tr, "hold")
    eng.hold_at, eng.hold_when = 2, lambda: getattr(tr, "updating_from", -1) == tr.engine.policy_version
    try:
        ms = [tr.step() for _ in range(8)]
    finally:
        tr.close()
    assert_trained_once_within_eta(tr.trained, 8 * 4 * 4, 2)  # every episode's rows in one batch, once
    cut = any(len(set(tv[r, a:b].tolist())) > 1 for _, _, _, tv, act in tr.trained for r in range(tv.shape[0])
              for a, b in _segments(act[r]))
    assert eng.done and cut, "no call was resumed across a publication"
    assert sum(m.get("agent_episodes", 0) for m in ms) >= 8 * 16 and all(m.get("agent_failed", 0) == 0 for m in ms)
    assert max(m["staleness_max"] for m in ms) <= 2 and ms[-1]["async_evicted"] == 0


def test_agents_whose_every_episode_fails_fail_the_step_naming_the_failure(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, 1, *_isolate(False), trainer=AsyncTrainer)
    runner = tr.generator.driver.agent.runner

    async def broken(sample, client):
        raise ConnectionError("sandbox unreachable")

    monkeypatch.setattr(runner, "program", broken)
    try:
        with pytest.raises(AgentError, match="(?s)no agent episode of step 0's 4 groups produced a row.*sandbox "
                                             "unreachable"):
            tr.step()
    finally:
        tr.close()


@pytest.mark.parametrize("isolate", [True, False])
def test_an_evaluation_never_waits_for_the_paused_units_slots_or_connections(tmp_path, isolate):
    # 4 units of 8 episodes fill the bound (32) and one HTTP pool (32 connections) with calls the evaluation's pause
    # holds: sharing them, the evaluation's episodes would wait for those calls' timeout (env.timeout_s) and fail
    tr = _trainer(tmp_path, 1, *_isolate(isolate), "--rollout.n=8",
                  "--rollout.max_concurrent_episodes=32", "--env.timeout_s=20", "--run.eval_prompts=8",
                  trainer=AsyncTrainer)
    try:
        for _ in range(2):
            tr.step()
        deadline = time.monotonic() + 10  # the units are running: their episodes await calls the pause will hold
        while not tr.generator.driver.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tr.generator.driver.calls, "no unit's call was waiting"
        t0 = time.monotonic()
        m = tr.evaluate()
        took = time.monotonic() - t0
        stats = dict(tr.generator.driver.agent.stats)
        after = tr.step()  # and the paused units go on
    finally:
        tr.close()
    assert stats["agent_failed"] == 0 and stats["agent_episodes"] == 8, stats
    assert took < 20, f"the evaluation took {took:.1f} s: it waited for the paused units"
    # the step after reports agent counts only for the rounds that ended since the evaluation (none may have, on a
    # loaded machine: their counts went to the evaluation's pop); none of them failed
    assert m["eval_tool_call_rate"] >= 0 and after.get("agent_failed", 0) == 0
