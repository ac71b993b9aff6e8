"""The load-time checks read what plug-ins declared where they registered, never their names: an engine registered
from a test file with the capabilities of the built-in ones passes the same checks, one without them is refused
naming it; an engine's ``validate`` runs with its arguments at load; a task lacking a member is refused naming it."""

import pytest

from hyperrl.config import ConfigError, load_config
from hyperrl.rollout.base import Capabilities
from hyperrl.rollout.engines import ENGINES, register_engine, transformers_capabilities
from hyperrl.rollout.workers import EXECUTORS, ExecutorCapabilities, register_executor


@pytest.fixture
def toy_engines():
    """``full``: declares what the transformers engine does; ``bare``: only resumable requests; ``picky``: refuses
    its argument ``mode=bad`` at load."""

    def picky_args(*, mode: str = "ok", **_):
        if mode == "bad":
            raise ValueError("mode=bad: not in this process; use mode=ok")

    register_engine("full", capabilities=lambda **_: transformers_capabilities())(lambda ctx: None)
    register_engine("bare", capabilities=Capabilities(resumable=True))(lambda ctx: None)

    def picky(ctx, *, mode: str = "ok"):
        """An engine with an argument checked together."""

    register_engine("picky", validate=picky_args)(picky)
    yield
    for name in ("full", "bare", "picky"):
        ENGINES.remove(name)


@pytest.mark.parametrize("extra,what", [
    (["--model.lm_head_fp32=true"], r"model.lm_head_fp32 with rollout.engine=bare"),
    (["--rollout.delta_publication=true"], r"rollout.delta_publication with rollout.engine=bare"),
    (["--model.vision={}"], r"rollout.engine=bare \(images go through"),
])
def test_an_engine_without_a_capability_is_refused_naming_it(toy_engines, extra, what):
    load_config(None, ["--rollout.engine=full", *extra])  # declared like the transformers engine: accepted
    with pytest.raises(ConfigError, match=what):
        load_config(None, ["--rollout.engine=bare", *extra])


def test_an_engines_tp_is_its_declaration(toy_engines):
    register_engine("split", capabilities=lambda **_: transformers_capabilities(tp=2))(lambda ctx: None)
    try:
        with pytest.raises(ConfigError, match=r"rollout.engine=split with tp=2: run.tp=1 needs the engine split"):
            load_config(None, ["--rollout.engine=split"])
    finally:
        ENGINES.remove("split")


def test_a_registered_validate_checks_the_arguments_at_load(toy_engines):
    load_config(None, ["--rollout.engine={name: picky, mode: ok}"])
    with pytest.raises(ConfigError, match=r"rollout.engine.mode=bad: not in this process; use mode=ok"):
        load_config(None, ["--rollout.engine={name: picky, mode: bad}"])
    with pytest.raises(ConfigError, match=r"rollout.engine.transport=cuda_ipc: CUDA IPC needs a CUDA GPU"):
        load_config(None, ["--rollout.engine={name: vllm, transport: cuda_ipc}"])  # vLLM's, before its import


def test_lora_adapters_follow_the_executors_declaration():
    """An engine receiving adapters with an executor whose workers cannot is refused naming the executor."""
    register_engine("adapters", capabilities=Capabilities(resumable=True, lora_adapters=True))(lambda ctx: None)
    register_executor("remote_only", capabilities=ExecutorCapabilities(remote=True))(lambda engine: None)
    base = ["--rollout.engine=adapters", "--model.lora={r: 4}", "--async.max_staleness=1"]
    try:
        load_config(None, [*base, "--async.executor=thread"])  # the thread executor's workers take adapters
        with pytest.raises(ConfigError, match=r"lora_adapters with async.executor=remote_only: the workers' engines"):
            load_config(None, [*base, "--async.executor=remote_only"])
    finally:
        ENGINES.remove("adapters")
        EXECUTORS.remove("remote_only")


def test_a_task_lacking_a_member_is_refused_naming_it():
    from hyperrl.data.tasks import TASKS, make_task, register_task
    from hyperrl.tokenizer import char_tokenizer

    class NoLimits:
        rewards = ()

        def sample(self, k, step, attempt=0):
            return []

        def held_out(self, k):
            return []

        def encode(self, s):
            return []

        def state(self):
            return {}

        def load_state(self, st):
            pass

    register_task("no_limits")(lambda tok, seed: NoLimits())
    try:
        cfg = load_config(None, ["--task=no_limits"])
        with pytest.raises(TypeError, match=r"task=no_limits: NoLimits lacks limits — a task has sample, held_out"):
            make_task(cfg.task, char_tokenizer(), 0)
    finally:
        TASKS.remove("no_limits")


def test_an_engine_lacking_what_its_capabilities_promise_is_refused_where_it_is_built():
    """A declared capability ties the optional members the loop calls (its protocol): an engine declaring deltas
    without ``stage_deltas`` / ``expect_deltas`` is refused when built, naming the flag and the members."""
    from hyperrl.rollout.base import CAPABILITY_PROTOCOLS, DeltaEngine
    from hyperrl.rollout.engines import build_engine
    from hyperrl.rollout.hf import TransformersEngine

    class HalfDelta:
        capabilities = Capabilities(deltas=True)

        def begin(self, version, *, partial=False, base=None):
            """Opens a publication."""

    register_engine("half_delta", capabilities=Capabilities(deltas=True))(lambda ctx: HalfDelta())
    try:
        with pytest.raises(TypeError, match=r"rollout.engine=half_delta: HalfDelta declares capabilities.deltas but "
                                            r"lacks expect_deltas, stage_deltas \(DeltaEngine\)"):
            build_engine("half_delta", {}, None)
    finally:
        ENGINES.remove("half_delta")
    assert CAPABILITY_PROTOCOLS["deltas"] is DeltaEngine and issubclass(TransformersEngine, DeltaEngine)
