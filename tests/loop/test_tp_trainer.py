"""SyncTrainer with a TP × FSDP2 policy (``run.tp=2`` on a dp 2 × tp 2 mesh of 4 real gloo
processes) publishing into the tensor-parallel engine's vLLM layout: each rank receives only its
fused shards, element-exact; the run learns; resume is bit-identical."""

import pytest
import torch

from tests.dist_helpers import run_gloo

pytestmark = [pytest.mark.dist]

_ARGS = ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}", "--model.hidden=64", "--model.intermediate=128",
         "--task=modsum", "--task.max_operand=1", "--rollout.max_new_tokens=1", "--rollout.n=8"]


def _worker(rank, world, out_dir, steps, prompts, lr, stop_save, resume):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.sharding.simulate import expected_destination

    torch.manual_seed(0)
    cfg = load_config(None, [f"--run.out_dir={out_dir}", f"--rollout.prompts_per_step={prompts}",
                             f"--optim.lr={lr}", *_ARGS])
    tr = build_trainer(cfg)
    start = None
    if resume:
        assert tr.resume()
        start = {k: p.full_tensor().detach().numpy().copy() for k, p in tr.policy.named_parameters()}
    metrics = []
    while tr.step_idx < steps:
        metrics.append(tr.step())
        if tr.step_idx == stop_save:
            tr.save()
    full = {k: p.full_tensor().detach() for k, p in tr.policy.named_parameters()}
    want = expected_destination(tr.engine.layout(world), full, ranks=[rank])[rank]
    got = {}  # the engine's served shards, re-fused from its local modules
    for name, (dim, targets) in tr.engine._splits.items():
        got[name] = torch.cat([p.detach() for p, _ in targets], dim)
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    plan = tr.publisher.publisher.plan
    recv = sum(t.nbytes for t in plan if t.dst_rank == rank and not t.local)
    skip = ("time_", "tokens_per_s")
    return {"version": tr.engine.policy_version, "bad": bad, "placements": sorted({str(p.placements) for p in
                                                                                  tr.policy.parameters()}),
            "recv": recv, "local": sum(t.nbytes for t in plan if t.dst_rank == rank and t.local),
            "full_bytes": sum(v.numel() * v.element_size() for v in full.values()),
            "metrics": [{k: v for k, v in m.items() if not k.startswith(skip)} for m in metrics],
            "weights": {k: v.numpy().copy() for k, v in full.items()} if steps <= 6 else None, "start": start}


def test_tp_fsdp_trainer_learns_and_publishes_shards_into_a_tp_engine(tmp_path):
    res = run_gloo(_worker, 4, str(tmp_path), 30, 16, 3e-3, -1, False, timeout=600)
    r0 = res[0]
    assert any("_StridedShard" in p for p in r0["placements"]), r0["placements"]  # FSDP2 over TP
    for r in range(4):
        assert res[r]["version"] == 30 and res[r]["bad"] == [], (r, res[r]["bad"])
        # each rank receives its shards only: what crosses + what it already holds < half the model
        assert res[r]["recv"] + res[r]["local"] < res[r]["full_bytes"] / 2 + 64 * 64 * 4, res[r]
        assert res[r]["metrics"] == r0["metrics"]  # one model, averaged metrics: the same on every rank
    rewards = [m["reward_mean"] for m in r0["metrics"]]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


def test_tp_fsdp_resume_is_bit_identical(tmp_path):
    straight = run_gloo(_worker, 4, str(tmp_path), 6, 8, 1e-3, 3, False, timeout=600)  # saves at step 3
    resumed = run_gloo(_worker, 4, str(tmp_path), 6, 8, 1e-3, -1, True, timeout=600)  # from step 3
    for r in range(4):
        assert resumed[r]["version"] == 6
        assert resumed[r]["metrics"] == straight[r]["metrics"][3:], r
        for k, v in straight[r]["weights"].items():
            assert (v == resumed[r]["weights"][k]).all(), (r, k)
    # the (dp, tp) checkpoint consolidates into the full HF state dict (meshes recorded per tensor)
    from hyperrl.loop.checkpoint import consolidate

    whole = consolidate(tmp_path / "checkpoints" / "step_3")
    for k, v in resumed[0]["start"].items():
        assert torch.equal(whole[k], torch.from_numpy(v)), k


def _grad_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrl.distributed import ParallelDims
    from hyperrl.distributed.parallelize import parallelize, tp_partial_params
    from hyperrl.distributed.strategy import TorchParallel
    from hyperrl.models.tiny import tiny_qwen3

    model = tiny_qwen3(50, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48, seed=1)
    model.train()
    whole = tiny_qwen3(50, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48, seed=1)
    whole.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (8, 6), generator=g)

    def loss_of(m, rows):  # Σ over rows of the next-token log-likelihood ÷ every token of the batch
        lp = m(input_ids=tokens[rows]).logits[:, :-1].log_softmax(-1)
        return -lp.gather(-1, tokens[rows, 1:, None]).sum() / (tokens.shape[0] * (tokens.shape[1] - 1))

    loss_of(whole, slice(None)).backward()
    par = TorchParallel(ParallelDims.from_env(tp=2))
    parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    par.sum_over_tp(tp_partial_params(model))
    mine = par.shard(list(range(8)))
    (loss_of(model, mine) * par.loss_scale).backward()
    params = list(model.parameters())
    par.sync_grads(params)
    norm = par.clip_grad_norm(params, 1e9)
    want = {k: p.grad for k, p in whole.named_parameters()}
    gap = {k: float((p.grad.full_tensor() - want[k]).abs().max()) for k, p in model.named_parameters()}
    full_norm = float(torch.nn.utils.clip_grad_norm_(whole.parameters(), 1e9))
    return {"gap": max(gap.values()), "worst": max(gap, key=gap.get), "norm": norm, "full_norm": full_norm,
            "rows": mine}


def test_tp_fsdp_gradients_equal_the_one_process_full_batch_gradient():
    """dp 2 × tp 2: the data sharded over dp (TP peers share rows), the loss scaled by dp, FSDP's
    reduce over dp, the q/k-norm partial gradients summed over TP, and the global norm over two
    meshes — together exactly the one-process gradient."""
    res = run_gloo(_grad_worker, 4)
    assert res[0]["rows"] == res[1]["rows"] != res[2]["rows"]  # a TP group shares its data-parallel share
    for r in range(4):
        assert res[r]["gap"] < 1e-6, (r, res[r]["worst"], res[r]["gap"])
        assert abs(res[r]["norm"] - res[r]["full_norm"]) < 1e-5 * res[r]["full_norm"], res[r]
