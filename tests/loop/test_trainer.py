import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.loop.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from hyperrl.loop.pipeline import build_pipeline
from hyperrl.loop.trainer import GateError
from hyperrl.rollout import WeightPublishError
from hyperrl.run import train
from tests.conftest import resign


def _cfg(tmp_path, *extra):
    return load_config(None, [f"--run.out_dir={tmp_path}", "--task=modsum", "--run.threads=1",
                              "--rollout.prompts_per_step=16",
                              "--rollout.n=4", "--rollout.max_new_tokens=1", "--model.hidden=64",
                              "--model.intermediate=128", "--run.eval_prompts=64", *extra])


@pytest.mark.slow
def test_default_task_learns_short_ci_config(tmp_path):
    # 4 contexts (operands 0..1): a clear rise from ≈ random (~0.01) within 80 steps, fixed seed
    cfg = _cfg(tmp_path, "--task.max_operand=1", "--run.steps=80", "--run.eval_every=40",
               "--rollout.prompts_per_step=32", "--rollout.n=8", "--optim.lr=3e-3")
    summary = train(cfg, progress=False)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert evals[0]["eval_reward_mean"] < 0.15
    assert summary["final_eval_reward"] > 0.8, evals
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    for key in ("reward_mean", "reward_std", "zero_variance_group_frac", "adv_mean", "loss_policy", "clipped_frac",
                "entropy", "approx_kl", "grad_norm", "tokens_per_s", "time_generate_s", "time_update_s",
                "time_publish_s", "policy_version", "mismatch_max_abs", "mismatch_k3"):
        assert key in steps[-1], key
    assert steps[-1]["policy_version"] == 80 and steps[-1]["mismatch_max_abs"] < 1e-5


@pytest.mark.slow
def test_the_default_arith_task_rises_in_a_short_ci_run(tmp_path):
    # the default job (two-digit sums, fixed width, 250 held-out operand pairs; digit_match + exact_answer)
    # for 300 of its steps, one thread, fixed seed: held-out per-place credit from ≈ 0 (random weights)
    # to ≥ 0.35 (seed 0 on 2 threads: 0.008 → 0.49; the whole run reaches ≥ 0.9 exact — benchmarks/seeds.py)
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--run.threads=1", "--run.steps=300", "--run.eval_every=150",
                             "--run.export=false"])
    assert cfg.task.name == "arith" and cfg.rollout.max_new_tokens == 3
    train(cfg, progress=False)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    first, last = evals[0]["eval_reward_digit_match_mean"], evals[-1]["eval_reward_digit_match_mean"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 300
    assert first < 0.1 and last >= 0.35, evals
    assert evals[-1]["eval_reward_exact_answer_mean"] >= evals[0]["eval_reward_exact_answer_mean"]


def _run_steps(cfg, n, resume=False):
    tr = build_trainer(cfg)
    if resume:
        assert tr.resume()
    out = []
    while tr.step_idx < n:
        out.append(tr.step())
        if tr.step_idx % 3 == 0:
            tr.save()
    return tr, out


def _same_metrics(a, b):
    skip = ("time_", "tokens_per_s")
    return [{k: v for k, v in m.items() if not k.startswith(skip)} for m in a] == \
        [{k: v for k, v in m.items() if not k.startswith(skip)} for m in b]


def test_resume_is_bit_identical(tmp_path):
    # a cosine schedule with warmup: its position (optimizer steps) is part of the checkpoint
    sched = ("--optim.schedule=cosine", "--optim.warmup_steps=2", "--optim.min_lr_ratio=0.1", "--run.steps=6")
    full, m_full = _run_steps(_cfg(tmp_path / "a", *sched), 6)
    _, m_first = _run_steps(_cfg(tmp_path / "b", *sched), 3)
    resumed, m_rest = _run_steps(_cfg(tmp_path / "b", *sched), 6, resume=True)
    assert resumed.engine.policy_version == 6
    assert _same_metrics(m_full[3:], m_rest)
    # lr = 1e-3 · multiplier: warmup 0.5, 1, then cosine from 1 down to 0.1 at the last step
    lrs = [m["lr"] for m in m_full]
    assert lrs[:2] == pytest.approx([5e-4, 1e-3]) and lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    for k, v in full.policy.state_dict().items():
        assert torch.equal(v, resumed.policy.state_dict()[k]), k


_CRASH = """
import sys
from hyperrl.config import load_config
from hyperrl.compose import build_trainer
cfg = load_config(None, sys.argv[1:])
tr = build_trainer(cfg)
tr.resume()
while tr.step_idx < 6:
    tr.step()
    if tr.step_idx == 3:
        tr.save()
tr.save(_crash_after="model")   # killed mid-write: no marker, never renamed
"""


@pytest.mark.slow
def test_kill_during_checkpoint_write_then_resume(tmp_path):
    cfg_args = [f"--run.out_dir={tmp_path / 'k'}", "--task=modsum", "--run.threads=1",
                "--rollout.prompts_per_step=16", "--rollout.n=4",
                "--rollout.max_new_tokens=1", "--model.hidden=64", "--model.intermediate=128"]
    proc = subprocess.run([sys.executable, "-c", _CRASH, *cfg_args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    ck = tmp_path / "k" / "checkpoints"
    assert (ck / "step_6.tmp").exists() and not (ck / "step_6").exists()
    assert latest_checkpoint(ck).name == "step_3"
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        load_checkpoint(ck / "step_6.tmp")
    resumed, _ = _run_steps(load_config(None, cfg_args), 6, resume=True)
    full, _ = _run_steps(_cfg(tmp_path / "u"), 6)
    for k, v in full.policy.state_dict().items():
        assert torch.equal(v, resumed.policy.state_dict()[k]), k


def test_wandb_without_the_package_names_key_and_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails here whether or not it is installed
    with pytest.raises(ValueError, match=r"run.wandb_project='p' needs wandb: `pip install wandb`"):
        train(_cfg(tmp_path, "--run.wandb_project=p", "--run.steps=1"), progress=False)


def test_vllm_engine_without_vllm_names_key_and_fix(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"rollout.engine=vllm: vllm is not installed.*setup_vllm.sh"):
        _cfg(tmp_path, "--rollout.engine=vllm")  # at load time: nothing has been built
    with pytest.raises(ConfigError, match="rollout.engine: unknown rollout engine 'vlm'"):
        _cfg(tmp_path, "--rollout.engine=vlm")


def test_rng_states_round_trip_without_pickle():
    import random

    import numpy as np

    from hyperrl.loop.checkpoint import rng_states, set_rng_states

    st = rng_states()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_states(st)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a
    assert all(t.dtype == torch.uint8 for t in st.values())  # plain bytes tensors in safetensors


def test_resume_refuses_other_world_size(tmp_path):
    tr, _ = _run_steps(_cfg(tmp_path), 3)
    state = tmp_path / "checkpoints" / "step_3" / "state.json"
    data = json.loads(state.read_text())
    data["world_size"] = 2
    state.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="state.json: checksum mismatch"):  # an edited file is damage
        load_checkpoint(tmp_path / "checkpoints" / "step_3")
    resign(state.parent, "state.json")  # signed as if written so: the world-size check behind it
    with pytest.raises(CheckpointError, match="world size 2, resuming with 1"):
        load_checkpoint(tmp_path / "checkpoints" / "step_3")


def test_publication_failure_leaves_v_serving_and_fails_closed(tmp_path):
    tr = build_trainer(_cfg(tmp_path))
    tr.step()
    served = {k: v.clone() for k, v in tr.engine.model.state_dict().items()}
    with torch.no_grad():
        next(tr.policy.parameters()).fill_(float("nan"))
    with pytest.raises(WeightPublishError, match="NaN"):
        tr.publish()
    assert tr.engine.policy_version == 1 and tr.version == 1
    assert all(torch.equal(v, tr.engine.model.state_dict()[k]) for k, v in served.items())


def test_a_shared_weights_engine_trains_like_a_copying_one(tmp_path):
    # the engine serving the policy itself: no second copy, publication a checked version bump —
    # and the same run, metric for metric, as the engine that copies
    _, copying = _run_steps(_cfg(tmp_path / "a"), 3)
    tr, shared = _run_steps(_cfg(tmp_path / "b", "--rollout.engine={name: transformers, share_weights: true}"), 3)
    assert tr.engine.model is tr.policy and tr.engine.policy_version == 3
    assert _same_metrics(copying, shared)


@pytest.mark.parametrize("extra, why", [
    (["--model.dtype=bfloat16"], r"model.dtype \(bfloat16\) differs from model.param_dtype \(float32\)"),
    (["--model.lora={r: 4}"], "with model.lora the engine serves merged weights"),
    (["--model.compile=eager"], "model.compile with rollout.engine.share_weights")])
def test_shared_weights_refused_where_it_cannot_hold(tmp_path, extra, why):
    with pytest.raises(ValueError, match=why):
        build_trainer(_cfg(tmp_path, "--rollout.engine={name: transformers, share_weights: true}", *extra))


def test_bit_exact_gate_refuses_update(tmp_path):
    # KV-cached decoding vs a full forward differ by float rounding (~5e-7 here), so gate at 1e-5
    tr = build_trainer(_cfg(tmp_path, "--algo.gate_threshold=1e-5"))
    tr.step()
    with torch.no_grad():
        for p in tr.engine.model.parameters():
            p.add_(1e-3)
    before = {k: v.clone() for k, v in tr.policy.state_dict().items()}
    with pytest.raises(GateError, match="gap .* > gate 1.000e-05.*still serving version 1"):
        tr.step()
    assert tr.engine.policy_version == 1
    assert all(torch.equal(v, tr.policy.state_dict()[k]) for k, v in before.items())  # no update happened


@pytest.mark.parametrize("overrides, message", [
    (["--algo.objectiv=gspo"], "unknown config key 'algo.objectiv'"),
    (["--run.steps=many"], "run.steps: 'many' is not valid — Input should be a valid integer"),
    (["--bogus.x=1"], "unknown config key 'bogus'"),
    (["--algo"], "expected --section.key=value"),
])
def test_bad_configs_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_registry_names_rejected(tmp_path):
    with pytest.raises(ConfigError, match="algo.objective: unknown policy objective 'gpso'"):
        _cfg(tmp_path, "--algo.objective=gpso")
    with pytest.raises(ConfigError, match="task: unknown task 'nope'"):
        _cfg(tmp_path, "--task.name=nope")


@pytest.mark.parametrize("config", sorted(str(p) for p in (Path(__file__).parents[2] / "configs").glob("*.yaml")))
def test_example_configs_build_and_step(tmp_path, config):
    cfg = load_config(config, [f"--run.out_dir={tmp_path}", "--rollout.prompts_per_step=4", "--rollout.n=2",
                               "--run.steps=1"])
    tr = build_trainer(cfg)
    m = tr.step()
    # dynamic sampling (dapo) may drop every group of a random policy: then nothing is updated or published
    assert m["policy_version"] == 1 - m.get("update_skipped", 0) and tr.engine.policy_version == m["policy_version"]


def test_an_all_filtered_batch_skips_update_and_publish(tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--algo.filter=dynamic_sampling", "--rollout.max_generation_batches=2"))
    tr.task.rewards = (("zero", lambda response, sample: 0.0),)  # every group constant: the filter keeps nothing
    before = {k: v.clone() for k, v in tr.policy.state_dict().items()}
    m = tr.step()
    assert m["update_skipped"] == 1.0 and m["policy_version"] == 0 and tr.engine.policy_version == 0
    assert m["filter_rounds"] == 2 and m["filter_kept_groups"] == 0 and m["filter_dropped_groups"] == 32
    assert all(torch.equal(before[k], v) for k, v in tr.policy.state_dict().items())


@pytest.mark.slow
def test_cli_train_writes_outputs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", f"--run.out_dir={tmp_path}", "--run.steps=2",
                          "--rollout.prompts_per_step=4", "--rollout.n=2", "--run.eval_every=1",
                          "--run.eval_prompts=8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "outputs in" in out.stdout and (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "reward_curve.png").exists() and latest_checkpoint(tmp_path / "checkpoints").name == "step_2"
    bad = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", "--algo.nope=1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "unknown config key 'algo.nope'" in bad.stderr


@pytest.mark.slow
def test_ppo_with_critic_learns_values_and_policy(tmp_path):
    cfg = _cfg(tmp_path, "--algo.recipe=ppo", "--algo.advantage.lam=0.95", "--algo.objective.clip_high=0.28",
               "--algo.entropy_coef=0.05",
               "--task.max_operand=1", "--rollout.prompts_per_step=32", "--rollout.n=8", "--optim.lr=3e-3",
               "--algo.critic.lr=1e-2")
    tr = build_trainer(cfg)
    ms = [tr.step() for _ in range(60)]
    assert "loss_value" in ms[-1] and "value_clipped_frac" in ms[-1]
    # the critic tracks the return: its mean value on action tokens is close to the mean reward
    samples = tr.task.sample(32, 999)
    batch = tr.scorer.score(tr.engine.generate([tr.task.encode(s) for s in samples], tr.generator.sampling(999), 8),
                       dict(enumerate(samples)))
    with torch.no_grad():
        v = tr.critic(batch)[batch["action_mask"]]
    assert abs(float(v.mean()) - float(batch["reward"].mean())) < 0.15
    first = sum(m["reward_mean"] for m in ms[:5]) / 5
    last = sum(m["reward_mean"] for m in ms[-5:]) / 5
    assert last > first + 0.3, (first, last)


def test_reference_kl_term(tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--algo.kl.coef=0.1"))
    assert tr.reference is not None
    m = [tr.step() for _ in range(3)]
    assert "loss_kl" in m[-1] and m[-1]["kl"] >= 0 and m[0]["kl"] < 1e-6  # starts at the reference


def test_local_hf_checkpoint_trains_with_its_own_tokenizer(tmp_path):
    from tests.hf_fixtures import qwen3_checkpoint

    ckpt = qwen3_checkpoint(tmp_path / "hf", seed=5)
    tr = build_trainer(_cfg(tmp_path / "run", f"--model.checkpoint={ckpt}", "--rollout.max_new_tokens=4"))
    assert len(tr.tok) == 380 and tr.tok.convert_ids_to_tokens(tr.tok.eos_token_id) == "<|im_end|>"
    sample = tr.task.sample(1, 0)[0]
    assert tr.task.encode(sample) == tr.tok.encode(sample.prompt)  # the BPE's ids, not characters
    m = tr.step()
    assert m["policy_version"] == 1 and tr.generator.sampling(0).eos_id == tr.tok.eos_token_id


def test_a_checkpoint_without_a_tokenizer_or_with_a_larger_one_is_refused(tmp_path):
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.tokenizer import TokenizerError
    from tests.hf_fixtures import bpe_tokenizer

    ckpt = tmp_path / "hf"
    tiny_qwen3(92, hidden=64, intermediate=128).save_pretrained(ckpt)
    with pytest.raises(ConfigError, match=r"model.checkpoint: .* has no tokenizer"):
        _cfg(tmp_path / "run", f"--model.checkpoint={ckpt}")
    bpe_tokenizer().save_pretrained(ckpt)  # 380 tokens for a 92-row embedding: ids would index past it
    with pytest.raises(TokenizerError, match="380 tokens but the model's vocabulary is 92"):
        build_trainer(_cfg(tmp_path / "run", f"--model.checkpoint={ckpt}"))


def _placement(tr):
    """(device, dtype) of every parameter, buffer and optimizer state, by owner."""
    out = {}
    mods = {"policy": tr.policy, "engine": tr.engine.model, "reference": tr.reference, "critic": tr.critic}
    for owner, mod in mods.items():
        if mod is not None:
            out[owner] = {(t.device.type, t.dtype) for t in [*mod.parameters(), *mod.buffers()]
                          if t.is_floating_point()}
    for name, part in tr.learner.modules.items():
        out[f"{name}_optim"] = {(v.device.type, v.dtype) for st in part.optimizer.state.values()
                                for k, v in st.items() if torch.is_tensor(v) and k != "step"}
    return out


def test_everything_is_on_the_configured_device_and_dtype_bf16(tmp_path):
    # bf16 compute over fp32 master weights (a pair the CPU supports): after a PPO step with a KL
    # reference, trainable weights and their optimizer state are fp32; the engine's and the
    # reference's weights bf16; the policy's activations bf16; log-probs and losses fp32.
    tr = build_trainer(_cfg(tmp_path, "--algo.recipe=ppo", "--algo.kl.coef=0.01", "--model.dtype=bfloat16",
                            "--rollout.max_new_tokens=2"))
    seen = set()
    # autocast: matmul outputs bf16 (the residual stream stays fp32 by type promotion)
    tr.policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda mod, a, out: seen.add(out.dtype))
    m = tr.step()
    fp32, bf16 = {("cpu", torch.float32)}, {("cpu", torch.bfloat16)}
    assert _placement(tr) == {"policy": fp32, "engine": bf16, "reference": bf16, "critic": fp32,
                              "policy_optim": fp32, "critic_optim": fp32}
    assert seen == {torch.bfloat16} and torch.isfinite(torch.tensor(m["loss_policy"]))
    from hyperrl.loop.collect import Timer

    lp, ent = tr.forwards.logprobs(tr.policy, tr.collect(Timer()).batch)
    assert lp.dtype == ent.dtype == torch.float32


def test_bf16_parameters_put_the_optimizer_state_in_bf16_too(tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--model.dtype=bfloat16", "--model.param_dtype=bfloat16"))
    tr.step()
    bf16 = {("cpu", torch.bfloat16)}
    assert _placement(tr) == {"policy": bf16, "engine": bf16, "policy_optim": bf16}


@pytest.mark.slow
def test_gradient_checkpointing_and_compile_train_to_the_same_losses(tmp_path):
    # checkpointing recomputes the same forward; compile (eager backend: tracing only) runs the same
    # ops; the first step's losses match the plain run (shared-prefix off in all three, as
    # checkpointing implies it)
    base = ("--rollout.max_new_tokens=3", "--optim.shared_prefix=false")
    runs = [build_trainer(_cfg(tmp_path / str(i), *base, *extra)).step()
            for i, extra in enumerate([(), ("--model.gradient_checkpointing=true",), ("--model.compile=eager",)])]
    for r in runs[1:]:
        assert r["loss_policy"] == pytest.approx(runs[0]["loss_policy"], rel=1e-5, abs=1e-7)
        assert r["reward_mean"] == runs[0]["reward_mean"]


def test_dynamic_sampling_refills_the_batch_to_the_configured_groups(tmp_path):
    # groups of 2 with a parity reward: about half are constant, so one round cannot fill 8 groups
    tr = build_trainer(_cfg(tmp_path, "--algo.recipe=dapo", "--rollout.n=2", "--rollout.prompts_per_step=8",
                            "--rollout.max_generation_batches=8", "--rollout.max_new_tokens=2"))
    tr.task.rewards = (("parity", lambda r, s: float(ord(r[0]) % 2) if r else 0.0),)
    m = tr.step()
    assert m["filter_kept_groups"] == 8 and m["filter_rounds"] >= 2 and m["filter_dropped_groups"] >= 1, m
    assert tr.samples_seen == 16 and m["zero_variance_group_frac"] == 0.0  # exactly 8 informative groups
    assert m["policy_version"] == 1


def test_adaptive_kl_controller_moves_beta_and_resumes_it(tmp_path):
    args = ("--algo.kl.coef=0.1", "--algo.kl.controller=adaptive", "--algo.kl.controller.horizon=100")
    tr = build_trainer(_cfg(tmp_path, *args))
    m = [tr.step() for _ in range(2)]
    # KL ≪ target 0.1 → err clipped to −0.2: β ← β·(1 − 0.2·64/100) per step (64 rows)
    assert m[0]["kl_coef"] == pytest.approx(0.1 * (1 - 0.2 * 64 / 100))
    assert m[1]["kl_coef"] == pytest.approx(0.1 * (1 - 0.2 * 64 / 100) ** 2)
    tr.save()
    again = build_trainer(_cfg(tmp_path, *args))
    assert again.resume() and again.kl_state.beta == tr.kl_state.beta


def test_a_user_extends_the_pipeline_in_python(tmp_path):
    import dataclasses

    import hyperrl.transforms as T

    seen = []

    def clip_adv(batch):  # a user stage after the recipe's advantages
        seen.append(float(batch["advantages"].abs().max()))
        return batch.copy().set("advantages", batch["advantages"].clamp(-0.5, 0.5))

    cfg = _cfg(tmp_path, "--task.max_operand=1")
    base = build_pipeline(cfg.algo)
    tr = build_trainer(cfg, pipeline=dataclasses.replace(base, transform=T.chain(base.transform, clip_adv)))
    assert tr.pipeline is tr.collector.pipeline  # one pipeline: the collector shapes with the one the trainer uses
    m = tr.step()
    assert seen[0] > 0.5 and m["adv_max_abs"] <= 0.5 and m["policy_version"] == 1  # the stage really clipped


def test_old_and_reference_logprobs_are_micro_batched(tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--algo.kl.coef=0.1", "--optim.micro_batch_tokens=40",
                            "--rollout.max_new_tokens=3"))
    calls = []
    orig = tr.policy.forward

    def counting(*a, **kw):
        calls.append(int(kw["input_ids"].numel()))
        return orig(*a, **kw)

    tr.policy.forward = counting
    from hyperrl.loop.collect import Timer

    batch = tr.collect(Timer()).batch
    out, _ = tr.prepare(batch)
    in_prepare = list(calls)
    with torch.no_grad():
        whole = tr.forwards.logprobs(tr.policy, batch)[0]
    m = batch["action_mask"]
    assert torch.allclose(out["old_logprobs"][m], whole[m], atol=1e-5)
    assert torch.allclose(out["ref_logprobs"][m], whole[m], atol=1e-5)  # the reference is the initial policy
    # every forward of prepare ran at most the 40-token budget; the whole batch is far larger
    assert len(in_prepare) > 2 and max(in_prepare) <= 40 < int(batch["attention_mask"].sum())


def test_the_loop_freezes_the_long_lived_heap_and_hands_it_back(tmp_path):
    """``train`` sets the objects alive at the loop's start aside from the cyclic GC while it runs (gc.freeze) and
    unfreezes them at the end; a process that froze objects itself keeps its own freeze."""
    import gc

    seen = []
    hook = lambda event, trainer, metrics: seen.append(gc.get_freeze_count()) if event == "step" else None  # noqa: E731
    cfg = _cfg(tmp_path, "--run.steps=2", "--run.eval_every=0")
    assert gc.get_freeze_count() == 0
    train(cfg, resume=False, progress=False, extra_hooks=[hook])
    assert len(seen) == 2 and min(seen) > 1000  # the models, the dataset, every imported module
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own freeze: left alone (not grown by the loop, not undone after it)
    try:
        mine, seen[:] = gc.get_freeze_count(), []
        train(_cfg(tmp_path / "b", "--run.steps=1", "--run.eval_every=0"), resume=False, progress=False,
              extra_hooks=[hook])
        # frozen objects that die leave the count, so "not grown" and "not undone" are ≤ and > 0
        assert len(seen) == 1 and seen[0] <= mine and 0 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()
