"""A TP × FSDP2 trainer's weights published into a vLLM-style TP engine layout, on 4 gloo processes.

The policy is a tiny Qwen3 under ``parallelize_qwen3`` on a (dp 2 × tp 2) mesh; its source layout
is read from the DTensor placements (strided shards included); the destination is vLLM's
layout for the same config at tp 2 × dp 2 (fused qkv with kv heads, fused gate_up, padded vocab).
Every rank receives only its intersection, element-exact against the full weights — direct and
full-gather executors alike."""

import pytest
import torch

from tests.dist_helpers import run_gloo

pytestmark = [pytest.mark.dist]


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrl.distributed.parallelize import parallelize_qwen3
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout.publisher import source_layout
    from hyperrl.sharding import reshard_plan, verify
    from hyperrl.sharding.dtensor import local
    from hyperrl.sharding.execute import execute_direct, execute_full_gather
    from hyperrl.sharding.models import from_hf_config
    from hyperrl.sharding.simulate import expected_destination
    from hyperrl.sharding.vllm import rollout_layout

    model = tiny_qwen3(100, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48, seed=3)
    model.config.tie_word_embeddings = False  # vLLM-style lm_head of its own (padded vocab, TP-split)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone() * 0.5)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_qwen3(model, mesh)
    src = source_layout(model, world)
    kinds = sorted({str(p.placements) for p in model.parameters()})
    cfg = from_hf_config(model.config.to_dict())
    dst = rollout_layout(cfg, tp=2, dp=2, dtype=torch.float32)  # colocated on the same 4 ranks
    plan = reshard_plan(src, dst)
    if rank == 0:
        verify(plan)
    shards = {k: local(p).detach() for k, p in model.named_parameters()}
    want = expected_destination(dst, full).get(rank, {})
    res = {"kinds": kinds, "stats": plan.stats()._asdict()}
    for name, run in (("direct", lambda o: execute_direct(plan, rank, shards, o)),
                      ("full_gather", lambda o: execute_full_gather(src, dst, rank, shards, o))):
        out = {n: torch.zeros(t.shape) for n, t in want.items()}  # padding rows (vocab 100 → 128) are never sent
        counters = run(out)
        bad = [n for n, t in want.items() if not torch.equal(out[n], t)]
        res[name] = {"bad": bad, "received": counters["received"]}
    return res


def test_tp_fsdp_trainer_publishes_its_intersections_into_a_tp_engine_layout():
    res = run_gloo(_worker, 4)
    r0 = res[0]
    assert any("_StridedShard" in k for k in r0["kinds"]), r0["kinds"]  # FSDP2 over TP: strided placements
    for r in range(4):
        assert res[r]["direct"]["bad"] == [] and res[r]["full_gather"]["bad"] == [], res[r]
    s = r0["stats"]
    assert s["wire_bytes"] == s["recv_min_bytes"] and s["local_bytes"] > 0
    direct = sum(res[r]["direct"]["received"] for r in range(4))
    gather = sum(res[r]["full_gather"]["received"] for r in range(4))
    assert direct == s["wire_bytes"] and gather > 2 * direct  # only the intersections cross, not whole tensors
