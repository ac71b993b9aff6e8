"""LoRA through PEFT: adapters train, the reference is the base with adapters disabled (no copy),
publication sends merged weights through the engine's transaction, checkpoints hold the
trainable tensors only, resume is bit-identical, the export is a merged HF model."""

import copy
import json

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.models.lora import AdapterDisabled, MergedView

TINY = ["--task=modsum", "--task.max_operand=1", "--rollout.max_new_tokens=1", "--rollout.prompts_per_step=32",
        "--rollout.n=8", "--run.threads=1",
        "--model.hidden=64", "--model.intermediate=128", "--run.eval_prompts=64"]
LORA = "--model.lora={r: 8, alpha: 16, train_modules: [model.norm]}"


def _tr(tmp_path, *extra):
    return build_trainer(load_config(None, [f"--run.out_dir={tmp_path}", *TINY, LORA, *extra]))


@pytest.mark.slow
def test_a_lora_run_learns_the_default_task(tmp_path):
    # adapters (r = 8 on every linear) + the final norm: 0.016 → ≈0.65 held-out in 160 steps here.
    # (Adapters alone cannot: with the frozen random embeddings of std 0.02 a logit is at most
    # |E_row|·√d ≈ 0.16·8 ≈ 1.3, so p(answer) ≤ ≈0.045 — measured ceiling 0.041.)
    tr = _tr(tmp_path, "--optim.lr=0.03")
    trainable = sum(p.numel() for p in tr.policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in tr.policy.parameters())
    assert trainable < total / 4
    first = tr.evaluate()["eval_reward_mean"]
    for _ in range(160):
        tr.step()
    last = tr.evaluate()["eval_reward_mean"]
    assert first < 0.1 and last > 0.4, (first, last)


def test_publication_sends_the_merged_weights(tmp_path):
    tr = _tr(tmp_path, "--optim.lr=0.03")
    for _ in range(3):
        tr.step()
    merged = copy.deepcopy(tr.policy).merge_and_unload().state_dict()  # PEFT's own merge, as the reference
    served = tr.engine.model.state_dict()
    assert set(served) == set(merged)
    assert max(float((served[k] - merged[k]).abs().max()) for k in merged) < 1e-6
    assert tr.engine.policy_version == 3
    assert any("base_layer" in n for n, _ in tr.policy.named_parameters())  # the policy itself is not merged
    assert all("base_layer" not in n and "lora_" not in n for n, _ in MergedView(tr.policy).named_parameters())


def test_the_reference_is_the_base_with_adapters_disabled(tmp_path):
    tr = _tr(tmp_path, "--algo.kl.coef=0.1", "--optim.lr=0.03")
    assert isinstance(tr.reference, AdapterDisabled) and tr.reference.inner is tr.policy  # no second copy
    init = copy.deepcopy(tr.engine.model)  # the base weights (B = 0 at start)
    m = [tr.step() for _ in range(3)]
    assert m[0]["kl"] < 1e-6 < m[-1]["kl"]  # starts at the reference, then moves away
    batch = tr.engine.generate([tr.task.encode(s) for s in tr.task.sample(4, 99)], tr.generator.sampling(0), 2)
    with torch.no_grad():
        ref, _ = tr.forwards.logprobs(tr.reference, batch)
        base, _ = tr.forwards.logprobs(init, batch)
    act = batch["action_mask"]
    assert torch.allclose(ref[act], base[act], atol=1e-6)


def test_checkpoints_hold_the_trainable_tensors_and_resume_bit_identically(tmp_path):
    a = _tr(tmp_path / "a", "--optim.lr=0.03")
    straight = [a.step() for _ in range(4)]
    b = _tr(tmp_path / "b", "--optim.lr=0.03")
    [b.step() for _ in range(2)]
    path = b.save()
    from safetensors.torch import load_file

    saved = load_file(path / "model.safetensors")
    trainable = {n for n, p in b.policy.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and any("lora_B" in n for n in saved) and any(n.endswith("model.norm.weight")
                                                                                 for n in saved)
    c = _tr(tmp_path / "b", "--optim.lr=0.03")
    assert c.resume() and c.step_idx == 2
    resumed = [c.step() for _ in range(2)]
    drop = ("time_", "tokens_per_s")
    for x, y in zip(straight[2:], resumed):
        assert {k: v for k, v in x.items() if not k.startswith(drop)} == \
            {k: v for k, v in y.items() if not k.startswith(drop)}
    for (n, p), (_, q) in zip(a.policy.named_parameters(), c.policy.named_parameters()):
        assert torch.equal(p, q), n


def test_a_lora_run_exports_a_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from hyperrl.export import export_hf

    tr = _tr(tmp_path, "--optim.lr=0.03")
    for _ in range(2):
        tr.step()
    export_hf(tr.save(), tmp_path / "hf")
    sd = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    merged = {k: v.detach() for k, v in MergedView(tr.policy).named_parameters()}
    assert max(float((sd[k] - merged[k]).abs().max()) for k in merged) < 1e-6
    assert "lora" not in json.dumps(sorted(sd))


@pytest.mark.parametrize("lora, match", [
    ("{target_modules: [q_proj, lm_head]}", "tied embed_tokens / lm_head"),
    ("{target_modules: [no_such_proj]}", r"\['no_such_proj'\] name no module"),
    ("{train_modules: [model.nope]}", r"\['model.nope'\] are not module paths")])
def test_bad_lora_configs_are_named(tmp_path, lora, match):
    with pytest.raises(ValueError, match=match):
        build_trainer(load_config(None, [f"--run.out_dir={tmp_path}", *TINY, f"--model.lora={lora}"]))
