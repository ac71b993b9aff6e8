"""Every config-shaped check runs when the config is loaded — before any model, engine, process
group or out_dir exists (they used to be raised by the trainer, the composition root, the
asynchronous trainer or the engine factories, after the policy and the engine were built)."""

import pytest

from hyperrl.config import ConfigError, load_config
from hyperrl.rollout.base import Capabilities
from hyperrl.rollout.engines import declared_capabilities

# each: overrides → the dotted key the error must name
LATE_CHECKS = [
    (["--algo.advantage=grpo_process", "--env=calculator_copy", "--task=products"], r"algo\.advantage"),
    (["--algo.proximal=interpolate", "--algo.gate_threshold=0.1"], r"algo\.proximal=interpolate"),
    (["--model.compile=eager", "--rollout.engine={name: transformers, share_weights: true}"], r"model\.compile"),
    (["--model.dtype=bfloat16", "--rollout.engine={name: transformers, share_weights: true}"],
     r"rollout\.engine\.share_weights: .*model\.dtype"),
    (["--model.lora={r: 4}", "--rollout.engine={name: transformers, share_weights: true}"],
     r"rollout\.engine\.share_weights: .*model\.lora"),
    (["--rollout.engine={name: vllm, lora_adapters: true}"], r"rollout\.engine"),  # vllm absent here, or no lora
    (["--async.max_staleness=1", "--rollout.engine={name: transformers, share_weights: true}"],
     r"rollout\.engine\.share_weights"),
    (["--async.max_staleness=1", "--async.schedule=gated", "--async.replay=x.jsonl"], r"async\.replay"),
    (["--async.max_staleness=1", "--async.kv_cache=keep", "--async.replay=x.jsonl"], r"async\.kv_cache=keep"),
    (["--async.max_staleness=1", "--async.kv_cache=keep", "--async.executor={name: ray}"],
     r"async\.kv_cache=keep: the ray executor"),
    (["--async.max_staleness=1", "--async.schedule=gated", "--async.max_concurrent=3"], r"async\.max_concurrent=3"),
    (["--async.max_staleness=1", "--algo.filter=dynamic_sampling"], r"async\.max_staleness: group filters"),
    (["--async.max_staleness=1", "--algo.recipe=remax"], r"async\.max_staleness: group filters"),
    (["--async.max_staleness=1", "--env=calculator_copy", "--task=products", "--async.replay=x.jsonl"],
     r"async\.replay with env"),
    (["--async.max_staleness=-1"], r"async\.max_staleness"),
]


@pytest.mark.parametrize("overrides, key", LATE_CHECKS, ids=[k for _, k in LATE_CHECKS])
def test_a_late_check_fails_at_load_naming_the_key(overrides, key, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=key):
        load_config(None, [f"--run.out_dir={out}", *overrides])
    assert not out.exists()  # nothing written: the load failed before anything existed


def test_the_world_size_checks_read_torchrun_s_environment_at_load(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun sets it before any process group exists
    load_config(None, ["--optim.pack_tokens=64"])  # packing under torchrun: the ranks agree their model calls
    with pytest.raises(ConfigError, match=r"async\.max_staleness: one learner process"):
        load_config(None, ["--async.max_staleness=1"])
    with pytest.raises(ConfigError, match=r"run\.tp=2: a critic"):
        load_config(None, ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}", "--algo.recipe=ppo"])
    with pytest.raises(ConfigError, match=r"share_weights: under torchrun"):
        load_config(None, ["--rollout.engine={name: transformers, share_weights: true}"])


def test_valid_combinations_still_load():
    load_config(None, ["--async.max_staleness=1", "--async.kv_cache=keep"])  # the thread executor parks
    load_config(None, ["--rollout.engine={name: transformers, share_weights: true}"])  # fp32, one process
    load_config(None, ["--algo.proximal=interpolate"])


def test_the_engines_declared_capabilities_are_what_they_build(tmp_path):
    """The config checks an engine's declared capabilities; the engine built must have exactly those."""
    from hyperrl.compose import build

    for args in ({}, {"share_weights": True}):
        spec = "{name: transformers" + "".join(f", {k}: {str(v).lower()}" for k, v in args.items()) + "}"
        tr = build(load_config(None, [f"--run.out_dir={tmp_path}", "--task=modsum", "--run.eval_every=0",
                                      f"--rollout.engine={spec}"]))
        assert tr.engine.capabilities == declared_capabilities("transformers", args)
        assert tr.engine.capabilities.shared_weights == bool(args)
    assert declared_capabilities("no-such-engine", {}) == Capabilities()


def test_every_async_schedule_is_a_config_choice():
    """``async.schedule`` is a Literal checked by pydantic at load; the collector builds the schedule
    object registered under the same name, so the two lists must agree."""
    from typing import get_args

    from hyperrl.config import AsyncConfig
    from hyperrl.rollout.workers.schedules import ASYNC_SCHEDULES, ReplaySchedule, make_schedule

    assert set(get_args(AsyncConfig.model_fields["schedule"].annotation)) == set(ASYNC_SCHEDULES.names())
    for name in ASYNC_SCHEDULES.names():
        assert make_schedule(name, None).name == name
    with pytest.raises(ValueError, match=r"async.replay: .* does not exist"):
        make_schedule("free", "/nonexistent/async_events.jsonl")
    assert ReplaySchedule.interrupts is False  # a replay stops where the recorded calls stopped, never by interrupt
