"""A tiny Qwen3-MoE policy in the trainer (configs/moe.yaml): the router's load-balancing loss is a ``loss_*``
term from the update's own forward (RouterTap), over the real tokens only, with per-layer load and entropy
metrics; the config refuses a top-k larger than the experts."""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hyperrl import transforms as T
from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.models import tiny_qwen3_moe
from hyperrl.models.moe import RouterTap, is_moe, moe_routers


def test_the_tap_sees_every_layer_and_the_real_tokens_as_the_family_does():
    model = tiny_qwen3_moe(40, experts=4, top_k=2, moe_intermediate=16, hidden=32, layers=3, head_dim=16, seed=3)
    assert is_moe(model) and len(moe_routers(model)) == 3
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 32, 32)  # [E, 2I, H], stacked
    ids = torch.randint(3, 40, (3, 7))
    am = torch.ones(3, 7, dtype=torch.long)
    am[1, 5:] = 0
    am[2, 2:] = 0
    with RouterTap(model) as tap:
        out = model(input_ids=ids, attention_mask=am, output_router_logits=True)
    assert len(tap.logits) == 3 and all(x.shape == (21, 4) for x in tap.logits)
    assert torch.equal(tap.mask, am.reshape(-1).bool())
    ours = T.load_balancing_loss(tap.logits, tap.top_k, tap.mask)
    assert ours.item() == pytest.approx(float(load_balancing_loss_func(out.router_logits, 4, 2, am)), rel=1e-5)
    ours.backward()  # the router learns from the term
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(model))
    model(input_ids=ids)  # hooks gone after the block
    assert len(tap.logits[0]) == 21


def test_a_moe_step_reports_the_router_terms_and_trains_the_router(tmp_path):
    cfg = load_config("configs/moe.yaml", [f"--run.out_dir={tmp_path}", "--rollout.prompts_per_step=4",
                                           "--rollout.n=4", "--run.threads=1", "--model.layers=2"])
    tr = build_trainer(cfg)
    try:
        before = [r.weight.detach().clone() for r in moe_routers(tr.policy)]
        m = tr.step()
    finally:
        tr.close()
    assert m["loss_router_aux"] == pytest.approx(0.001 * m["moe_aux_loss"], rel=1e-5)
    assert {"moe_load_max_l0", "moe_load_max_l1", "moe_router_entropy_l0", "moe_router_entropy"} <= set(m)
    assert 1.0 <= m["moe_load_max"] <= 8 / 2 + 1e-5 and 0 < m["moe_router_entropy"] <= 2.0795
    assert any(not torch.equal(b, r.weight) for b, r in zip(before, moe_routers(tr.policy)))


def test_a_top_k_above_the_experts_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"model.experts_per_token=3: must be ≤ model.experts \(2\)"):
        load_config("configs/moe.yaml", ["--model.experts=2", "--model.experts_per_token=3"])
