"""Plans from an HF config.json: for each family the layouts name exactly the tensors (and shapes) a
real transformers model of that config saves, and plan exactly."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import transformers

from hyperrl.sharding import reshard_plan, verify
from hyperrl.sharding.models import from_hf_config, hf_tensor_shapes, trainer_layout
from hyperrl.sharding.simulate import expected_destination, random_state, simulate
from hyperrl.sharding.vllm import rollout_layout

ATTN = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", ATTN),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**ATTN, "head_dim": 8, "tie_word_embeddings": True}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", ATTN),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**ATTN, "moe_intermediate_size": 16, "num_experts": 4,
                                                          "num_experts_per_tok": 2,
                                                          "shared_expert_intermediate_size": 24}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**ATTN, "head_dim": 8, "moe_intermediate_size": 16,
                                                          "num_experts": 4, "num_experts_per_tok": 2,
                                                          "mlp_only_layers": [0]}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **ATTN, "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_group": 1, "topk_group": 1}),
    # a vision-language model: the tower (4 heads, so tp=2 splits it) and the projector beside a Qwen2 language model
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {
        "text_config": {**ATTN, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                                                    "rope_theta": 1e6}},
        "vision_config": {"depth": 2, "hidden_size": 16, "intermediate_size": 24, "num_heads": 4,
                          "out_hidden_size": 32, "fullatt_block_indexes": [1]}}),
}


def _checkpoint(tmp_path, family):
    from safetensors import safe_open

    cfg_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layouts_from_config_json_name_the_saved_tensors_and_plan_exactly(tmp_path, family):
    saved = _checkpoint(tmp_path, family)
    cfg = from_hf_config(tmp_path)  # the directory; the file works too
    if family == "qwen2_5_vl":  # the file keeps the original names; the model (and its publisher) holds these
        saved = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
                 for k, v in saved.items()}
    assert hf_tensor_shapes(cfg) == saved  # every tensor the checkpoint holds, by name and shape
    ep = 2 if cfg.experts else 1
    src = trainer_layout(cfg, fsdp=2, tp=1, ep=ep, dtype=torch.float32)
    dst = rollout_layout(cfg, tp=2, dp=2, dtype=torch.float32, offset=0)  # colocated: some copies are local
    plan = reshard_plan(src, dst)
    verify(plan)
    full = random_state(src, seed=2)
    got, want = simulate(plan, full), expected_destination(dst, full)
    assert all(torch.equal(got[r][n], t) for r, ps in want.items() for n, t in ps.items())
    s = plan.stats()
    assert s.wire_bytes == s.recv_min_bytes and s.local_bytes > 0


def test_unsupported_or_incomplete_configs_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not modelled; supported: qwen2"):
        from_hf_config(tmp_path / "config.json")
    with pytest.raises(ValueError, match="'num_hidden_layers' is missing"):
        from_hf_config({"model_type": "qwen3", "hidden_size": 8, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="no such file"):
        from_hf_config(tmp_path / "nope")


@pytest.mark.slow
def test_cli_plans_a_config_json_colocated(tmp_path):
    _checkpoint(tmp_path, "qwen3_moe")
    out = subprocess.run([sys.executable, "-m", "hyperrl.cli", "plan", "--model", str(tmp_path / "config.json"),
                          "--trainer", "fsdp=2,ep=2", "--rollout", "tp=2,dp=2", "--colocated", "--fan-out", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["trainer_ranks"] == 4 and info["rollout_ranks"] == 4 and info["local_bytes"] > 0
    assert info["wire_bytes"] == info["recv_min_bytes"] and info["egress_bytes"] == info["src_min_bytes"]
    bad = subprocess.run([sys.executable, "-m", "hyperrl.cli", "plan", "--model", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--model:" in bad.stderr and "no such file" in bad.stderr
    # a vision-language model: its tower is planned too; a tower tp cannot split is named, --vision-dp replicates it
    cmd = [sys.executable, "-m", "hyperrl.cli", "plan", "--model", "qwen2.5-vl-3b", "--trainer", "fsdp=2",
           "--rollout", "tp=8", "--json"]
    split = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert split.returncode != 0 and "MLP width 3420 is not divisible by 8" in split.stderr
    whole = subprocess.run(cmd + ["--vision-dp", "--compare", "vllm-m2n"], capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr
    info = json.loads(whole.stdout)
    assert info["wire_bytes"] == info["recv_min_bytes"] and info["hyperrl_over_m2n"] < 1


def test_vision_tower_follows_vllm_tensor_parallel_rules():
    """vLLM's Qwen2.5-VL tower at tp=2, by hand: rank r's ``attn.qkv`` is its half of the q heads, then of the k
    heads, then of the v heads of the checkpoint's fused [q; k; v] (``QKVParallelLinear`` on an already fused
    tensor); ``gate_up_proj`` its half of gate then of up (biases alike); ``attn.proj`` its column half with the
    whole bias; the projector's ``mlp.0`` a row half, ``mlp.2`` a column half; norms and the patch Conv3d whole.
    The language model is served as ``language_model.model.*``."""
    cfg = from_hf_config({"model_type": "qwen2_5_vl", **FAMILIES["qwen2_5_vl"][2]})
    assert cfg.vision.merger_hidden == 64 and cfg.qkv_bias and not cfg.qk_norm
    src = trainer_layout(cfg, fsdp=2, dtype=torch.float32)
    dst = rollout_layout(cfg, tp=2, dtype=torch.float32, offset=2)
    full = random_state(src, seed=3)
    want = expected_destination(dst, full)
    plan = reshard_plan(src, dst)
    verify(plan)
    got = simulate(plan, full)
    v, D, I = "model.visual.blocks.0.", 16, 24
    for r in (0, 1):
        mine = got[2 + r]
        h = slice(r * D // 2, (r + 1) * D // 2)
        for n in ("weight", "bias"):
            qkv = full[v + "attn.qkv." + n]
            assert torch.equal(mine["visual.blocks.0.attn.qkv." + n], torch.cat([qkv[h], qkv[D:][h], qkv[2 * D:][h]]))
            half = slice(r * I // 2, (r + 1) * I // 2)
            assert torch.equal(mine["visual.blocks.0.mlp.gate_up_proj." + n],
                               torch.cat([full[v + "mlp.gate_proj." + n][half], full[v + "mlp.up_proj." + n][half]]))
        assert torch.equal(mine["visual.blocks.0.attn.proj.weight"], full[v + "attn.proj.weight"][:, h])
        assert torch.equal(mine["visual.blocks.0.attn.proj.bias"], full[v + "attn.proj.bias"])
        assert torch.equal(mine["visual.merger.mlp.0.weight"], full["model.visual.merger.mlp.0.weight"][r * 32:][:32])
        assert torch.equal(mine["visual.merger.mlp.2.weight"],
                           full["model.visual.merger.mlp.2.weight"][:, r * 32:][:, :32])
        assert torch.equal(mine["visual.patch_embed.proj.weight"], full["model.visual.patch_embed.proj.weight"])
        assert torch.equal(mine["language_model.model.norm.weight"], full["model.language_model.norm.weight"])
        assert all(torch.equal(mine[n], t) for n, t in want[2 + r].items())
    # the tower whole on every rank (vLLM's mm_encoder_tp_mode="data"): the fused qkv arrives as the checkpoint has it
    rep = rollout_layout(cfg, tp=2, dtype=torch.float32, offset=2, vision_dp=True)
    got = simulate(reshard_plan(src, rep), full)
    assert torch.equal(got[3]["visual.blocks.0.attn.qkv.weight"], full[v + "attn.qkv.weight"])
    # a tower whose widths tp cannot split is named, with the way out
    with pytest.raises(ValueError, match="vision tower's heads 4 is not divisible by 8.*mm_encoder_tp_mode"):
        rollout_layout(replace(cfg, heads=8, kv_heads=8), tp=8, dtype=torch.float32)


def test_vllm_engine_hands_its_loader_the_fused_vision_qkv_as_one_checkpoint_tensor():
    """A whole (tp = 1) engine parameter back to checkpoint views (what vLLM's ``load_weights`` takes): the vision
    block's ``attn.qkv`` — three windows of one tensor, end to end — is that tensor once; ``gate_up_proj`` is its
    two sources one after the other; the language model's ``qkv_proj`` its q, k, v."""
    from hyperrl.rollout.vllm_engine import _checkpoint_views

    cfg = from_hf_config({"model_type": "qwen2_5_vl", **FAMILIES["qwen2_5_vl"][2]})
    lay = rollout_layout(cfg, tp=1, dtype=torch.float32).params
    v = "model.visual.blocks.0."
    assert _checkpoint_views(lay["visual.blocks.0.attn.qkv.weight"]) == [(v + "attn.qkv.weight", 0, (48, 16))]
    assert _checkpoint_views(lay["visual.blocks.0.attn.qkv.bias"]) == [(v + "attn.qkv.bias", 0, (48,))]
    assert _checkpoint_views(lay["visual.blocks.0.mlp.gate_up_proj.weight"]) == [
        (v + "mlp.gate_proj.weight", 0, (24, 16)), (v + "mlp.up_proj.weight", 24 * 16, (24, 16))]
    lm = "model.language_model.layers.0.self_attn."
    assert [n for n, _, _ in _checkpoint_views(lay["language_model.model.layers.0.self_attn.qkv_proj.weight"])] == \
        [lm + "q_proj.weight", lm + "k_proj.weight", lm + "v_proj.weight"]
