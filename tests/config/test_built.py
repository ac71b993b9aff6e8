"""The post-build checks in one place (``hyperrl.config.built.check_built``): what needs the built task or policy is
refused before any parallelism is applied or an engine started, naming the key and the fix."""

from types import SimpleNamespace

import pytest

from hyperrl.config import ConfigError, load_config
from hyperrl.config.built import check_built
from hyperrl.data.tasks import TaskLimits
from hyperrl.distributed import ParallelDims
from hyperrl.models import tiny_qwen3
from hyperrl.models.tiny import tiny_qwen3_moe

TASK = SimpleNamespace(limits=lambda: TaskLimits(response_tokens=3, longest_prompt=6))  # what the checks read


def _moe():
    return tiny_qwen3_moe(40, experts=4, top_k=2, moe_intermediate=32, hidden=32, layers=1, heads=2, kv_heads=1,
                          head_dim=16, seed=1)


@pytest.mark.parametrize(("over", "moe", "critic", "why"), [
    ([], False, False, "the policy is dense (model.experts=0)"),
    (["--model.lora={r: 4}"], True, False, "model.lora"),
    ([], True, True, "a critic"),
    (["--model.gradient_checkpointing=true"], True, False, "model.gradient_checkpointing"),
])
def test_expert_parallelism_refuses_what_it_does_not_train(tmp_path, over, moe, critic, why):
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", *over])
    policy = _moe() if moe else tiny_qwen3(40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=1)
    with pytest.raises(ConfigError, match=rf"run.ep=2: expert parallelism here trains an MoE policy \(and a "
                                          rf"reference\) — not with {why.replace('(', '.').replace(')', '.')}; set "
                                          "run.ep=1"):
        check_built(cfg, task=TASK, policy=policy, dims=ParallelDims(world=2, ep=2), critic=critic)


def test_an_moe_policy_passes_and_the_budget_is_checked_first(tmp_path):
    cfg = load_config(None, [f"--run.out_dir={tmp_path}"])
    check_built(cfg, task=TASK, policy=_moe(), dims=ParallelDims(world=2, ep=2))  # nothing to refuse
    short = load_config(None, [f"--run.out_dir={tmp_path}", "--rollout.max_new_tokens=2"])
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=2: task 'arith' has answers of up to 2 tokens "
                                          r"\+ EOS; set rollout.max_new_tokens ≥ 3"):
        check_built(short, task=TASK, policy=_moe(), dims=ParallelDims(world=2, ep=2))


def test_the_longest_prompt_and_the_budget_must_fit_the_context(tmp_path):
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--rollout.max_new_tokens=8"])
    policy = tiny_qwen3(40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=1)
    policy.config.max_position_embeddings = 12
    check_built(cfg, task=SimpleNamespace(limits=lambda: TaskLimits(3, 4)), policy=policy)  # 4 + 8 = 12 fits
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=8 \+ the longest prompt \(5 tokens\) = 13 "
                                          r"exceeds the model's context \(max_position_embeddings=12\)"):
        check_built(cfg, task=SimpleNamespace(limits=lambda: TaskLimits(3, 5)), policy=policy)


def test_packing_refuses_a_family_whose_attention_cannot_take_packed_sequences(tmp_path):
    """optim.pack_tokens on a family whose attention is its own code (not transformers' attention interface, which
    masks packed rows off each other): refused naming the family and the fix; a Qwen3 passes."""
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--optim.pack_tokens=4096"])
    own = tiny_qwen3(40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=1)
    check_built(cfg, task=TASK, policy=own)  # a family on the interface
    own._supports_attention_backend = False
    with pytest.raises(ConfigError, match=r"optim.pack_tokens=4096: Qwen3ForCausalLM cannot take packed sequences "
                                          r".* set optim.pack_tokens=0"):
        check_built(cfg, task=TASK, policy=own)
