"""The tensor-parallel transformers engine on real gloo process groups: vLLM's fused layout served
by HF modules, generation identical to the unsplit model, publication all-or-nothing per group."""

import copy

import pytest
import torch

from tests.dist_helpers import run_gloo

pytestmark = [pytest.mark.dist]


def _model(kv_heads: int, tied: bool = True):
    from hyperrl.models.tiny import tiny_qwen3

    m = tiny_qwen3(100, hidden=32, layers=2, heads=4, kv_heads=kv_heads, head_dim=8, intermediate=48, seed=3)
    if not tied:
        m.config.tie_word_embeddings = False
        m.lm_head.weight = torch.nn.Parameter(m.model.embed_tokens.weight.detach().clone() * 0.5)
    return m


def _generate_worker(rank, world, kv_heads, tied):
    from hyperrl.rollout.hf import TransformersEngine
    from hyperrl.rollout.tp import TPTransformersEngine
    from hyperrl.sampling import SamplingParams

    m = _model(kv_heads, tied)
    eng, ref = TPTransformersEngine(copy.deepcopy(m), 2), TransformersEngine(copy.deepcopy(m))
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, eos_id=2)
    a, b = eng.generate([[1, 5, 6], [1, 7]], sp, 3), ref.generate([[1, 5, 6], [1, 7]], sp, 3)
    shapes = {k: list(v.shape) for k, v in eng._expected().items()}
    return {"same": bool(torch.equal(a["tokens"], b["tokens"])), "tokens": a["tokens"].tolist(),
            "gap": float((a["rollout_logprobs"] - b["rollout_logprobs"]).abs().max()), "shapes": shapes}


@pytest.mark.parametrize("kv_heads,tied", [(2, True), (1, False)])
def test_tp_engine_generates_what_the_whole_model_generates(kv_heads, tied):
    res = run_gloo(_generate_worker, 2, kv_heads, tied)
    for r in (0, 1):
        assert res[r]["same"] and res[r]["gap"] < 1e-5, res[r]
    assert res[0]["tokens"] == res[1]["tokens"]
    s = res[0]["shapes"]
    # fused qkv: 2 local q heads + this rank's kv heads (kv_heads=1 < tp: the one head replicated), head_dim 8
    kv_local = max(kv_heads // 2, 1)
    assert s["model.layers.0.self_attn.qkv_proj.weight"] == [(2 + 2 * kv_local) * 8, 32]
    assert s["model.layers.0.mlp.gate_up_proj.weight"] == [2 * 24, 32]
    assert s["model.layers.0.mlp.down_proj.weight"] == [32, 24]
    assert s["model.embed_tokens.weight"] == [64, 32]  # vocab 100 padded to 128, split over 2
    assert ("lm_head.weight" in s) == (not tied)


def _refusal_worker(rank, world):
    from hyperrl.rollout.base import WeightPublishError
    from hyperrl.rollout.tp import TPTransformersEngine
    from hyperrl.sampling import SamplingParams
    from hyperrl.sharding.simulate import expected_destination

    m = _model(2)
    eng = TPTransformersEngine(copy.deepcopy(m), 2)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, eos_id=2)
    before = eng.generate([[1, 5, 6]], sp, 2)["tokens"]
    new = {k: v.detach() * 1.5 for k, v in m.state_dict().items()}
    mine = expected_destination(eng.layout(world), new, ranks=[rank])[rank]
    if rank == 1:  # only rank 1's piece is bad: rank 0 alone would accept its own
        mine["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    eng.begin(1)
    eng.stage(mine)
    try:
        eng.commit()
        refused = None
    except WeightPublishError as e:
        refused = str(e)
    after = eng.generate([[1, 5, 6]], sp, 2)["tokens"]
    mine = expected_destination(eng.layout(world), new, ranks=[rank])[rank]
    eng.load_weights(mine, 2)  # a clean publication afterwards goes through on both
    return {"refused": refused, "version": eng.policy_version, "same": bool(torch.equal(before, after))}


def test_a_piece_refused_on_one_rank_is_refused_by_the_whole_group():
    res = run_gloo(_refusal_worker, 2)
    assert "NaN" in res[1]["refused"] and "another rank" in res[0]["refused"], res
    for r in (0, 1):
        assert res[r]["same"] and res[r]["version"] == 2  # version 0 kept serving, then 2 went through
