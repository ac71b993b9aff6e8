"""vLLM 0.32's own many-to-many resharder (nccl_m2n) in bytes, beside hyperrl's plan (issue 33, item 3): the rule
read from vllm/distributed/weight_transfer/m2n_layout.py — plain column / row-parallel parameters direct, fused and
stacked ones (qkv, gate_up, experts, the vocabulary) whole to every rank — checked by hand on a tiny Qwen3 and
through the CLI on Qwen3-30B-A3B, where hyperrl's busiest rank receives under 1/4 of it."""

import json

import torch

from hyperrl.sharding.m2n import m2n_received_bytes, m2n_rule
from hyperrl.sharding.models import MODELS


def test_rules_name_the_direct_parameters():
    assert m2n_rule("model.layers.0.self_attn.o_proj.weight") == "row"
    assert m2n_rule("model.layers.0.mlp.down_proj.weight") == "row"
    assert m2n_rule("model.layers.5.mlp.shared_experts.down_proj.weight") == "row"
    assert m2n_rule("model.layers.0.self_attn.kv_b_proj.weight") == "column"
    for fused in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                  "model.layers.3.mlp.experts.7.down_proj.weight", "model.layers.3.mlp.experts.7.gate_proj.weight",
                  "model.layers.0.self_attn.q_a_proj.weight", "model.embed_tokens.weight", "lm_head.weight",
                  "model.norm.weight", "model.layers.3.mlp.gate.weight"):
        assert m2n_rule(fused) == "whole", fused


def test_tiny_qwen3_by_hand():
    # qwen3-tiny: hidden 64, 2 layers, 4 heads × 16, 2 kv heads, MLP 96, vocab 250, tied; bf16, tp = 2.
    # Per layer direct: o_proj 64·64/2 + down_proj 64·96/2 = 2,048 + 3,072 = 5,120 elements;
    # whole: q 4,096 + k 2,048 + v 2,048 + q_norm 16 + k_norm 16 + gate 6,144 + up 6,144 + two norms 128 = 20,640.
    # Two layers: 10,240 direct + 41,280 whole; + embed 16,000 + final norm 64 → 57,344 whole; per rank
    # 67,584 elements = 135,168 bytes. Whole tensors: 9 per layer + embed + norm = 20 of 24.
    got = m2n_received_bytes(MODELS["qwen3-tiny"], tp=2, dtype=torch.bfloat16)
    assert got.direct == 2 * 10_240 and got.fallback == 2 * 57_344 and got.per_rank == 135_168
    assert (got.fallback_tensors, got.tensors) == (20, 24)


def test_cli_compares_with_m2n_and_hyperrl_receives_under_a_quarter_at_ep_to_tp(capsys):
    from hyperrl.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--trainer", "fsdp=2,ep=8", "--rollout", "tp=8,dp=2",
                 "--compare", "vllm-m2n", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    total = 30_532_122_624 * 2  # Qwen3-30B-A3B's parameters in bf16 (the model's size: what m2n sends each rank)
    assert 0.97 * total < info["m2n_in_per_rank"] < total
    assert info["hyperrl_over_m2n"] <= 0.25 and info["max_in"] * 16 >= info["recv_min_bytes"]
