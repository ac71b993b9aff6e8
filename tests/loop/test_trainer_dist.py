"""SyncTrainer under FSDP2 on 2 real gloo processes, publishing through the reshard planner."""

import pytest
import torch

from tests.dist_helpers import run_gloo

pytestmark = [pytest.mark.dist]


def _worker(rank, world, out_dir):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    torch.manual_seed(0)
    cfg = load_config(None, [f"--run.out_dir={out_dir}", "--rollout.prompts_per_step=32", "--rollout.n=8",
                             "--model.hidden=64", "--model.intermediate=128", "--task=modsum",
                             "--task.max_operand=1", "--rollout.max_new_tokens=1",
                             "--optim.lr=3e-3"])
    tr = build_trainer(cfg)
    assert type(tr.policy).__name__.startswith("FSDP"), type(tr.policy)
    metrics = [tr.step() for _ in range(40)]
    full = {k: p.full_tensor() for k, p in tr.policy.named_parameters()}
    served = tr.engine.model.state_dict()
    engine_equals_policy = all(torch.equal(served[k], v) for k, v in full.items())
    transfers = sum(1 for t in tr.publisher.publisher.plan if not t.local)
    return {"version": tr.engine.policy_version, "engine_equals_policy": engine_equals_policy,
            "rewards": [m["reward_mean"] for m in metrics], "remote_transfers": transfers,
            "checksum": float(sum(v.detach().double().sum() for v in full.values()))}


def test_fsdp2_two_processes_learn_and_publish(tmp_path):
    res = run_gloo(_worker, 2, str(tmp_path))
    a, b = res[0], res[1]
    assert a["version"] == b["version"] == 40
    assert a["engine_equals_policy"] and b["engine_equals_policy"]  # every replica got the full new weights
    assert a["remote_transfers"] > 0  # shards really crossed processes
    assert a["checksum"] == b["checksum"]  # both ranks hold the same model
    assert a["rewards"] == b["rewards"]  # metrics are averaged over ranks
    assert sum(a["rewards"][-5:]) / 5 > sum(a["rewards"][:5]) / 5 + 0.2, a["rewards"]


def _ckpt_worker(rank, world, out_dir, stop, resume):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    cfg = load_config(None, [f"--run.out_dir={out_dir}", "--rollout.prompts_per_step=8", "--rollout.n=4",
                             "--model.hidden=64", "--model.intermediate=128"])
    tr = build_trainer(cfg)
    if resume:
        assert tr.resume()
    metrics = []
    while tr.step_idx < stop:
        metrics.append(tr.step())
        if tr.step_idx == 3:
            tr.save()
    full = {k: p.full_tensor().detach().numpy().copy() for k, p in tr.policy.named_parameters()}  # by value
    skip = ("time_", "tokens_per_s")
    return full, [{k: v for k, v in m.items() if not k.startswith(skip)} for m in metrics], tr.engine.policy_version


def test_fsdp2_checkpoint_resume_is_identical(tmp_path):
    full = run_gloo(_ckpt_worker, 2, str(tmp_path / "a"), 6, False)
    run_gloo(_ckpt_worker, 2, str(tmp_path / "b"), 3, False)
    resumed = run_gloo(_ckpt_worker, 2, str(tmp_path / "b"), 6, True)
    assert resumed[0][2] == 6
    assert resumed[0][1] == full[0][1][3:]  # the same metrics for steps 4..6
    for k, v in full[0][0].items():
        assert (v == resumed[0][0][k]).all(), k
    # a 2-process checkpoint is refused by a 1-process run
    import pytest

    from hyperrl.loop.checkpoint import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="world size 2, resuming with 1"):
        load_checkpoint(tmp_path / "b" / "checkpoints" / "step_3", world_size=1)


def _critic_worker(rank, world, out_dir, stop, resume):
    """PPO + critic, both FSDP2-sharded; multi-token answers and a small micro-batch token budget, so
    ranks hold different lengths and micro-batch counts (padded with zero-weight passes)."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    cfg = load_config("configs/ppo_critic.yaml", [
        f"--run.out_dir={out_dir}", "--rollout.prompts_per_step=8", "--rollout.n=4", "--rollout.max_new_tokens=3",
        "--model.hidden=64", "--model.intermediate=128", "--task=modsum", "--task.max_operand=99",
        "--optim.micro_batch_tokens=17",
        "--optim.mini_batches=2"])
    tr = build_trainer(cfg)
    assert type(tr.critic).__name__.startswith("FSDP"), type(tr.critic)
    if resume:
        assert tr.resume()
    metrics, micro_counts = [], []
    orig = tr.parallel.pad_micro_batches

    def counting(micros):
        out = orig(micros)
        micro_counts.append((sum(m is not None for m in out), len(out)))
        return out

    tr.parallel.pad_micro_batches = counting
    while tr.step_idx < stop:
        metrics.append(tr.step())
        if tr.step_idx == 2:
            tr.save()
    full = {f"{n}/{k}": p.full_tensor().detach().numpy().copy()
            for n, mod in (("policy", tr.policy), ("critic", tr.critic)) for k, p in mod.named_parameters()}
    skip = ("time_", "tokens_per_s")
    return full, [{k: v for k, v in m.items() if not k.startswith(skip)} for m in metrics], micro_counts


def test_fsdp2_critic_uneven_micro_batches_and_sharded_resume(tmp_path):
    import numpy as np

    from hyperrl.loop.checkpoint import consolidate

    full = run_gloo(_critic_worker, 2, str(tmp_path / "a"), 4, False)
    counts = full[0][2] + full[1][2]
    assert any(real < padded for real, padded in counts), counts  # some rank really ran a padding pass
    assert all(m["policy_version"] == i + 1 for i, m in enumerate(full[0][1]))
    assert all("loss_value" in m for m in full[0][1])
    run_gloo(_critic_worker, 2, str(tmp_path / "b"), 2, False)
    ck = tmp_path / "b" / "checkpoints" / "step_2"
    names = sorted(p.name for p in ck.iterdir())
    assert "model.rank0.safetensors" in names and "critic_optim.rank1.safetensors" in names
    assert "model.safetensors" not in names  # nothing was gathered into a full copy
    resumed = run_gloo(_critic_worker, 2, str(tmp_path / "b"), 4, True)
    assert resumed[0][1] == full[0][1][2:]  # identical metrics for steps 3..4
    for k, v in full[0][0].items():
        assert np.array_equal(v, resumed[0][0][k]), k
    # one process reassembles full tensors from both ranks' shards with the recorded specs
    weights = consolidate(ck, "model")
    mid = run_gloo(_critic_worker, 2, str(tmp_path / "c"), 2, False)
    for k, v in mid[0][0].items():
        if k.startswith("policy/"):
            assert np.array_equal(weights[k.removeprefix("policy/")].numpy(), v), k


def test_torchrun_cli_trains_checkpoints_sharded_and_resumes(tmp_path):
    import json
    import socket
    import subprocess
    import sys

    from hyperrl.loop.checkpoint import latest_checkpoint

    def run(steps):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(port), "-m", "hyperrl.cli", "train", f"--run.out_dir={tmp_path}",
                               f"--run.steps={steps}", "--run.ckpt_every=2", "--rollout.prompts_per_step=8",
                               "--rollout.n=4", "--run.eval_every=0", "--run.threads=1", "--model.hidden=64",
                               "--model.intermediate=128"], capture_output=True, text=True, timeout=300)

    first = run(3)
    assert first.returncode == 0, first.stderr[-3000:]
    ck = latest_checkpoint(tmp_path / "checkpoints")
    assert ck.name == "step_3" and (ck / "model.rank1.safetensors").exists()
    second = run(5)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 3" in second.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in rows].count("resume") == 1  # the resume is recorded once, by rank 0
    rows = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # rank 0 alone logs; the resumed run appends
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5]  # the engine was refitted to version 3


def _bf16_worker(rank, world, out_dir):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.sharding.dtensor import local

    cfg = load_config(None, [f"--run.out_dir={out_dir}", "--task=modsum", "--rollout.prompts_per_step=8",
                             "--rollout.n=4",
                             "--model.hidden=64", "--model.intermediate=128", "--model.dtype=bfloat16",
                             "--rollout.max_new_tokens=2", "--run.eval_prompts=3", "--run.eval_n=2"])
    tr = build_trainer(cfg)
    seen = set()
    tr.policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
    metrics = [tr.step() for _ in range(2)]
    states = {v.dtype for st in tr.learner.modules["policy"].optimizer.state.values() for k, v in st.items()
              if torch.is_tensor(v) and k != "step"}
    return {"param_dtypes": sorted({str(local(p).dtype) for p in tr.policy.parameters()}),
            "optim_dtypes": sorted(str(d) for d in states), "compute": sorted(str(d) for d in seen),
            "engine": sorted({str(p.dtype) for p in tr.engine.model.parameters()}),
            "loss_finite": all(abs(m["loss_policy"]) < 1e3 for m in metrics), "version": tr.engine.policy_version,
            "eval": tr.evaluate(), "share": len(tr.parallel.shard(tr.task.held_out(3)))}


def test_fsdp2_mixed_precision_bf16_compute_over_fp32_shards(tmp_path):
    # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on gloo: the sharded master
    # weights and AdamW state stay fp32, the layers compute in bf16, the engine serves bf16
    res = run_gloo(_bf16_worker, 2, str(tmp_path))
    for r in res.values() if isinstance(res, dict) else res:
        assert r["param_dtypes"] == ["torch.float32"] and r["optim_dtypes"] == ["torch.float32"]
        assert r["compute"] == ["torch.bfloat16"] and r["engine"] == ["torch.bfloat16"]
        assert r["loss_finite"] and r["version"] == 2
    # evaluation is sharded (2 + 1 of the 3 held-out prompts) and its sums all-reduced: equal metrics
    a, b = (res[0], res[1])
    assert (a["share"], b["share"]) == (2, 1) and a["eval"] == b["eval"]


def _sync_worker(rank, world):
    from hyperrl.distributed.strategy import make_parallel

    par = make_parallel()
    torch.manual_seed(rank)  # different weights per rank until replicate()
    model = par.replicate(torch.nn.Linear(3, 2))
    x = torch.arange(24, dtype=torch.float32).reshape(8, 3) / 10
    y = torch.ones(8, 2)
    mine = x[rank::world], y[rank::world]
    # the global normaliser is the full batch's 8 rows: each rank's loss is its share of the sum
    (((model(mine[0]) - mine[1]) ** 2).sum() / 8 * par.loss_scale).backward()
    par.sync_grads(model.parameters())
    return ({k: p.detach().numpy().copy() for k, p in model.named_parameters()},  # by value, not shared memory
            {k: p.grad.numpy().copy() for k, p in model.named_parameters()}, x.numpy(), y.numpy())


def test_replicated_gradients_sum_to_the_full_batch_gradient():
    res = run_gloo(_sync_worker, 2)
    (w0, g0, x, y), (w1, g1, _, _) = res[0], res[1]
    assert all((w0[k] == w1[k]).all() for k in w0)  # rank 0's weights everywhere
    full = torch.nn.Linear(3, 2)
    full.load_state_dict({k: torch.from_numpy(v) for k, v in w0.items()})
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    (((full(x) - y) ** 2).sum() / 8).backward()  # one process, the whole batch
    for k, p in full.named_parameters():
        assert (g0[k] == g1[k]).all(), k
        assert torch.allclose(torch.from_numpy(g0[k]), p.grad, atol=1e-6), (k, g0[k], p.grad)


def _lora_worker(rank, world, out_dir, stop, resume):
    """LoRA under torchrun: the frozen base replicated, the adapters' gradients all-reduced."""
    import copy

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.models.lora import MergedView

    cfg = load_config(None, [f"--run.out_dir={out_dir}", "--rollout.prompts_per_step=32", "--rollout.n=8",
                             "--model.hidden=64", "--model.intermediate=128", "--task=modsum",
                             "--task.max_operand=1", "--rollout.max_new_tokens=1",
                             "--optim.lr=0.03", "--model.lora={r: 8, alpha: 16, train_modules: [model.norm]}"])
    tr = build_trainer(cfg)
    assert not type(tr.policy).__name__.startswith("FSDP")
    if resume:
        assert tr.resume()
    metrics = []
    while tr.step_idx < stop:
        metrics.append(tr.step())
        if tr.step_idx == 3:
            tr.save()
    merged = {k: v.detach().clone() for k, v in MergedView(tr.policy).named_parameters()}
    peft = copy.deepcopy(tr.policy).merge_and_unload().state_dict()
    served = tr.engine.model.state_dict()
    skip = ("time_", "tokens_per_s")
    return {"params": {k: p.detach().numpy().copy() for k, p in tr.policy.named_parameters()},
            "engine_gap": max(float((served[k] - peft[k]).abs().max()) for k in peft),
            "engine_is_merged": all(torch.equal(served[k], v) for k, v in merged.items()),
            "merged": {k: v.numpy() for k, v in merged.items()},
            "metrics": [{k: v for k, v in m.items() if not k.startswith(skip)} for m in metrics],
            "version": tr.engine.policy_version, "eval": tr.evaluate()["eval_reward_mean"]}


def test_lora_under_two_processes_learns_publishes_and_resumes(tmp_path):
    res = run_gloo(_lora_worker, 2, str(tmp_path / "a"), 160, False)
    a, b = res[0], res[1]
    assert a["version"] == b["version"] == 160
    for k, v in a["params"].items():  # adapters, norm and frozen base stay identical on both ranks
        assert (v == b["params"][k]).all(), k
    assert a["engine_is_merged"] and b["engine_is_merged"] and a["engine_gap"] < 1e-6
    rewards = [m["reward_mean"] for m in a["metrics"]]
    assert a["metrics"] == b["metrics"]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.3, (rewards, a["eval"])
    # resume: steps 4..6 after a restart from step 3 equal the uninterrupted run's
    mid = run_gloo(_lora_worker, 2, str(tmp_path / "b"), 3, False)
    # the per-rank checkpoint (full adapter tensors on each rank) exports a merged HF model
    from transformers import AutoModelForCausalLM

    from hyperrl.export import export_hf

    hf = AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "b" / "checkpoints" / "step_3", tmp_path / "hf"))
    exported = hf.state_dict()
    assert max(float(abs(exported[k].numpy() - v).max()) for k, v in mid[0]["merged"].items()) < 1e-6
    resumed = run_gloo(_lora_worker, 2, str(tmp_path / "b"), 6, True)
    assert resumed[0]["metrics"] == a["metrics"][3:6]
    straight = run_gloo(_lora_worker, 2, str(tmp_path / "c"), 6, False)
    for k, v in straight[0]["params"].items():
        assert (v == resumed[0]["params"][k]).all(), k
