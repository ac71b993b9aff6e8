"""One driver per kind of rollout, chosen once from the environment's declared capabilities, used by both
collectors: a driver added from a test file runs the synchronous rounds and the asynchronous units."""

import pytest

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.envs import EnvCapabilities
from hyperrl.loop.drivers import ROLLOUT_DRIVERS, AgentDriver, EpisodeDriver, PlainDriver, make_driver


def test_the_kind_is_chosen_once_from_the_declaration():
    assert type(make_driver()) is PlainDriver and not make_driver().multi_turn
    env = object()
    assert type(make_driver(env, EnvCapabilities())) is EpisodeDriver
    d = make_driver(env, EnvCapabilities(owns_loop=True))
    assert type(d) is AgentDriver and d.agent is env and d.several_rows and d.multi_turn
    assert ROLLOUT_DRIVERS.in_order() == ["plain", "episodes", "agent"]


class Counting(PlainDriver):
    """Plain rollouts, counting what each side asked of it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rounds, self.opened = 0, []

    def generate(self, gen, samples, sampling, n, group_offset, uids, step):
        self.rounds += 1
        return super().generate(gen, samples, sampling, n, group_offset, uids, step)

    def open(self, unit):
        self.opened.append(unit.key)
        return super().open(unit)


@pytest.mark.parametrize("eta", [None, 0])
def test_a_driver_of_ones_own_drives_both_collectors(tmp_path, monkeypatch, eta):
    """Synchronous: each step's round and each evaluation is the driver's ``generate``; asynchronous (η = 0, the
    same batches): each admitted unit's requests come from its ``open`` — keys 0, 1, … in admission order."""
    driver = Counting()
    monkeypatch.setattr("hyperrl.compose.make_driver", lambda env, caps: driver)  # what the composition root chose
    over = {} if eta is None else {"max_staleness": eta}
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--run.steps=2", "--run.eval_every=0",
                             "--rollout.prompts_per_step=2", "--rollout.n=2"])
    tr = build_trainer(cfg, **over)
    try:
        assert tr.generator.driver is driver
        m = [tr.step() for _ in range(2)]
        tr.evaluate()
    finally:
        tr.close()
    assert all(x["reward_mean"] >= 0 for x in m)
    if eta is None:
        assert driver.rounds == 3 and driver.opened == []  # 2 steps + 1 evaluation
    else:
        assert driver.rounds == 1 and driver.opened[:4] == [0, 1, 2, 3]  # the evaluation: a synchronous round
