"""Executors on 4 real gloo processes: every destination shard equals the slice of the full tensor.

All cases run inside one 4-process gloo job (spawning is the expensive part); each case checks
every destination parameter on every rank against the slice of the full tensor.
"""

import pytest
import torch

from tests.dist_helpers import run_gloo

CASES = {
    # name: (model, trainer kwargs, rollout kwargs)
    "dense_colocated": ("qwen3-tiny", dict(fsdp=4), dict(tp=2, dp=2)),
    "strided_fsdp_tp_kv_replicated": ("qwen3-tiny", dict(fsdp=2, tp=2), dict(tp=4)),
    "uneven_disjoint": ("qwen3-tiny", dict(fsdp=2), dict(tp=2, offset=2)),  # vocab 250 -> padded 256, 125/2
    "experts_tp": ("qwen3-moe-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=2)),
    "experts_ep_round_robin": ("qwen3-moe-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=2, ep=4,
                                                                         expert_placement="round_robin")),
    "mla_shared_experts": ("deepseek-tiny", dict(fsdp=2, ep=2), dict(tp=4)),
    # a vision-language model: the tower's fused attn.qkv split head-wise third by third, the projector, the LM
    "vision_tower_tp": ("qwen2.5-vl-tiny", dict(fsdp=2), dict(tp=4)),
}
RUNS = [(c, "direct", False, 4096) for c in CASES] + [(c, "direct", True, 1 << 20) for c in CASES] + \
    [(c, "full_gather", False, 1 << 16) for c in ("dense_colocated", "experts_ep_round_robin", "uneven_disjoint")]


def _run_all(rank, world):
    from hyperrl.sharding import reshard_plan
    from hyperrl.sharding.execute import execute_direct, execute_full_gather
    from hyperrl.sharding.models import MODELS, trainer_layout
    from hyperrl.sharding.simulate import expected_destination, random_state, source_shards
    from hyperrl.sharding.vllm import rollout_layout

    out = {}
    for case, executor, fan_out, cap in RUNS:
        model, tr, ro = CASES[case]
        cfg = MODELS[model]
        src = trainer_layout(cfg, dtype=torch.float32, **tr)
        dst = rollout_layout(cfg, dtype=torch.float32, **ro)
        full = random_state(src, seed=7)  # every process builds the same full tensors (test only)
        my_src = source_shards(src, full).get(rank, {})
        want = expected_destination(dst, full).get(rank, {})
        mine = {k: torch.zeros_like(v) for k, v in want.items()}  # labels are never 0: misses show
        if executor == "direct":
            counters = execute_direct(reshard_plan(src, dst, fan_out=fan_out), rank, my_src, mine, max_bytes=cap)
        else:
            counters = execute_full_gather(src, dst, rank, my_src, mine, max_bytes=cap)
        out[(case, executor, fan_out)] = ([k for k in want if not torch.equal(mine[k], want[k])], counters)
    return out


# every test here reads the one 4-process run: one xdist worker for all (README test command: --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("sharding_execute"), pytest.mark.dist]


@pytest.fixture(scope="module")
def results():
    return run_gloo(_run_all, 4)


@pytest.mark.parametrize("case, executor, fan_out", [(c, e, f) for c, e, f, _ in RUNS])
def test_executor_exact(results, case, executor, fan_out):
    for rank, res in results.items():
        bad, _ = res[(case, executor, fan_out)]
        assert not bad, f"rank {rank}: wrong params {bad[:3]}"


def test_fan_out_same_bytes_received(results):
    for case in CASES:
        plain = sum(res[(case, "direct", False)][1]["received"] + res[(case, "direct", False)][1]["local"]
                    for res in results.values())
        fan = sum(res[(case, "direct", True)][1]["received"] + res[(case, "direct", True)][1]["local"]
                  for res in results.values())
        assert plain == fan, case  # every destination element still arrives exactly once
