"""An fp32 LM head (issue 31, item 4): under bf16 compute the head's logits are the fp32 product of its input
and weight (not bf16-rounded), in the trainer's autocast forward and in a bf16 engine copied from the policy;
the loop builds both sides with it; engines that would still compute a bf16 head are refused at load."""

import copy

import pytest
import torch

from hyperrl.models import tiny_qwen3
from hyperrl.models.head import fp32_lm_head, has_fp32_lm_head


def _model():
    return tiny_qwen3(40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=3)


def _hidden_and_logits(model, ids, **kw):
    out = model(input_ids=ids, output_hidden_states=True, **kw)
    return out.hidden_states[-1], out.logits


def test_the_head_is_an_fp32_product_under_autocast_and_in_a_bf16_copy():
    ids = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    plain, patched = _model(), fp32_lm_head(_model())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, z = _hidden_and_logits(patched, ids)
        _, z_bf16 = _hidden_and_logits(plain, ids)
    assert z.dtype == torch.float32 and z_bf16.dtype == torch.bfloat16
    want = torch.nn.functional.linear(h.float(), patched.lm_head.weight.float())
    assert torch.equal(z, want)  # the fp32 product of the (bf16) hidden state and the fp32 master weight
    assert float((z - z_bf16.float()).abs().max()) > 0  # the bf16 head rounds
    engine = copy.deepcopy(patched).to(torch.bfloat16)  # what the transformers engine serves
    assert has_fp32_lm_head(engine) and not has_fp32_lm_head(plain)
    h, z = _hidden_and_logits(engine, ids)
    assert z.dtype == torch.float32
    assert torch.equal(z, torch.nn.functional.linear(h.float(), engine.lm_head.weight.float()))


def test_the_loop_builds_the_policy_reference_and_engine_with_it(tmp_path):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path}", "--model.lm_head_fp32=true",
                                          "--model.dtype=bfloat16", "--algo.kl.coef=0.01", "--run.eval_every=0",
                                          "--rollout.engine={name: transformers, dtype: bfloat16}",
                                          "--rollout.prompts_per_step=4", "--run.threads=1"]))
    assert has_fp32_lm_head(tr.policy) and has_fp32_lm_head(tr.engine.model) and has_fp32_lm_head(tr.reference)
    m = tr.step()
    assert m["policy_version"] == 1 and m["mismatch_max_abs"] < 0.1


def test_a_tensor_parallel_engine_that_would_compute_a_bf16_head_is_refused(monkeypatch):
    """(vLLM is refused the same way where it is installed: the check reads only the engine's name.)"""
    from hyperrl.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "2")  # the world torchrun would give
    with pytest.raises(ConfigError, match=r"model.lm_head_fp32 with tensor parallelism: the fp32 head is built"):
        load_config(None, ["--model.lm_head_fp32=true", "--run.tp=2", "--rollout.engine={name: transformers, tp: 2}"])
