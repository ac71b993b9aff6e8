"""A tensor-parallel vLLM engine's publication without vLLM: each worker's shards cut from the whole (tp = 1)
parameters by :func:`~hyperrl.sharding.vllm.worker_cuts` equal vLLM's layout at that tp, and the bytes the
``shm`` transport hands each worker (:class:`~hyperrl.rollout.transports.shm.WorkerShards`) are the plan's
per-rank ``B_recv_min`` — a trainer rank planning into the engine's workers. The config's refusals of ``tp``
and ``sleep`` are here too; the real engine is tests/vllm/check_vllm_tp.py."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.config import ConfigError, load_config
from hyperrl.rollout.transports.shm import WorkerShards
from hyperrl.sharding import Layout, Mesh, Placement, Spec, reshard_plan
from hyperrl.sharding.models import MODELS, ModelShape, hf_tensor_shapes
from hyperrl.sharding.simulate import expected_destination
from hyperrl.sharding.vllm import rollout_layout, worker_cuts


def _checkpoint(cfg: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in hf_tensor_shapes(cfg).items()}


def _cut(whole: torch.Tensor, local_shape, cuts) -> torch.Tensor:
    out = torch.zeros(local_shape)
    for src, dst, _ in cuts:
        out[dst.slices()] = whole[src.slices()]
    return out


shapes = st.sampled_from([MODELS["qwen3-tiny"], MODELS["qwen3-moe-tiny"],
                          ModelShape("qwen2-like", 32, 1, 4, 1, 8, 64, 100, False, qk_norm=False, qkv_bias=True)])


@settings(max_examples=12, deadline=None)
@given(shapes, st.sampled_from([2, 4]), st.integers(0, 3))
def test_each_workers_cut_of_the_whole_parameters_is_vllms_shard_at_that_tp(cfg, tp, seed):
    full = _checkpoint(cfg, seed)
    whole, split = rollout_layout(cfg, tp=1, dtype=torch.float32), rollout_layout(cfg, tp=tp, dtype=torch.float32)
    served = expected_destination(whole, full, ranks=[0])[0]  # what the driver is handed: vLLM's params, whole
    want = expected_destination(split, full)  # vLLM's shards at tp, from the layout's definition
    for name, p in split.params.items():
        cuts = worker_cuts(whole.params[name], p)
        for r in range(tp):
            assert torch.equal(_cut(served[name], p.local_shape(r), cuts[r]), want[r][name]), (name, r)


@pytest.mark.parametrize("model,tp", [("qwen3-tiny", 2), ("qwen3-tiny", 4), ("qwen3-moe-tiny", 2)])
def test_the_bytes_each_worker_reads_are_the_plans_per_rank_b_recv_min(model, tp):
    cfg = MODELS[model]
    full = _checkpoint(cfg, 0)
    whole, split = rollout_layout(cfg, tp=1, dtype=torch.float32), rollout_layout(cfg, tp=tp, dtype=torch.float32)
    shapes_r = [{n: torch.empty(p.local_shape(r), device="meta") for n, p in split.params.items()} for r in range(tp)]
    tr = WorkerShards(shapes_r, torch.float32, {n: worker_cuts(whole.params[n], p) for n, p in split.params.items()})
    try:
        for name, t in expected_destination(whole, full, ranks=[0])[0].items():
            tr.stage(name, t)
        # a trainer on rank 0, the workers ranks 1..tp (offset: nothing is local) — each worker's inbound bytes
        src = Layout({k: Placement(tuple(v.shape), torch.float32, Spec.replicate(v.dim()), Mesh.of(fsdp=1))
                      for k, v in full.items()})
        plan = reshard_plan(src, rollout_layout(cfg, tp=tp, dtype=torch.float32, offset=1))
        inbound = [0] * tp
        for t in plan:
            inbound[t.dst_rank - 1] += t.src_slice.numel * 4
        assert tr.received == inbound
        model_bytes = sum(v.numel() * 4 for v in full.values())
        assert max(inbound) < model_bytes  # no worker reads a whole model (vLLM's own path: every one does)
        # and the segments hold exactly the layout's shards (padding rows zero)
        want = expected_destination(split, full)
        for r, w in enumerate(tr.workers):
            for n in split.params:
                assert torch.equal(w._slot(n), want[r][n]), (r, n)
        payloads = tr.payload({n: None for n in split.params}, None, 1)[0]
        assert len(payloads) == tp and len({p[0] for p in payloads}) == tp  # one segment per worker
    finally:
        tr.close()


@pytest.mark.parametrize("engine,match", [
    ("{name: vllm, tp: 64}", r"rollout\.engine\.tp=64: this machine has \d+ (GPUs|CPU cores)"),
    ("{name: vllm, tp: 0}", r"rollout\.engine\.tp=0: must be ≥ 1"),
    ("{name: vllm, tp: 2, transport: file}", r"rollout\.engine\.transport=file: a tensor-parallel vLLM engine .*shm"),
    ("{name: vllm, sleep: 3}", r"rollout\.engine\.sleep=3: vLLM's sleep levels are 1 .* and 2"),
])
def test_the_config_refuses_a_tp_or_sleep_this_machine_cannot_run(engine, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"--rollout.engine={engine}"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_sleep_is_refused_at_load_where_vllm_cannot_sleep():
    with pytest.raises(ConfigError, match=r"rollout\.engine\.sleep=1: vLLM's sleep mode needs its CUDA memory pool"):
        load_config(None, ["--rollout.engine={name: vllm, sleep: 1}"])


def test_tp_that_does_not_split_the_model_is_named_with_its_numbers():
    with pytest.raises(ValueError, match=r"rollout tp=3: qwen3-tiny has 4 attention heads.*tp ∈ \{1, 2, 4\}"):
        rollout_layout(MODELS["qwen3-tiny"], tp=3)
    odd = ModelShape("odd-vocab", 64, 1, 8, 8, 8, 64, 65, True)  # pads to 128 rows: 8 ranks split it, 3 do not
    rollout_layout(odd, tp=8)


def test_a_sleeping_engine_is_refused_in_the_asynchronous_loop(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where vLLM can sleep (its check is CUDA's)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from hyperrl.rollout.engines import ENGINES

    vllm = ENGINES.factory("vllm")  # this environment has no vLLM: the check under test comes after that one
    monkeypatch.setattr(type(vllm), "check_requirements", lambda self, key: None)
    load_config(None, ["--rollout.engine={name: vllm, sleep: 1}"])  # synchronous: it sleeps during the update
    with pytest.raises(ConfigError, match=r"rollout\.engine\.sleep=1 with async\.max_staleness=1: .*never sleeps"):
        load_config(None, ["--rollout.engine={name: vllm, sleep: 1}", "--async.max_staleness=1"])


def test_replicas_of_tp_engines_must_fit_the_machine(monkeypatch):
    from hyperrl.rollout.engines import ENGINES

    vllm = ENGINES.factory("vllm")
    monkeypatch.setattr(type(vllm), "check_requirements", lambda self, key: None)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["--rollout.engine={name: vllm, tp: 2}", "--async.max_staleness=1"]
    load_config(None, args + ["--async.executor={name: ray, workers: 1}"])  # 2 TP workers on 2 cores
    with pytest.raises(ConfigError, match=r"2 workers × rollout\.engine=vllm's 2 TP workers each = 4 devices; this "
                                          r"machine has 2 CPU cores .*VLLM_CPU_OMP_THREADS_BIND"):
        load_config(None, args + ["--async.executor={name: ray, workers: 2}"])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # the cores shared knowingly
    load_config(None, args + ["--async.executor={name: ray, workers: 2}"])
    load_config(None, args + ["--async.executor={name: ray, workers: 2, address: auto}"])  # a cluster's nodes
