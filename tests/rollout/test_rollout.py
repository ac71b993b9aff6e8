import pytest
import torch

from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rollout import SamplingParams, TransformersEngine, WeightPublishError, filter_logits
from hyperrl.tokenizer import char_tokenizer
from hyperrl.trajectory import validate
from hyperrl.transforms import sequence_logprobs

TOK = char_tokenizer()


@pytest.fixture(scope="module")
def engine():
    return TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=0))


def _fresh_logprobs(model, batch, temperature):
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).logits
    return sequence_logprobs(logits, batch["tokens"], temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_logprobs_match_fresh_forward(engine, temperature):
    prompts = [TOK.encode("1+2="), TOK.encode("13+24="), TOK.encode("7")]
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, eos_id=TOK.eos_token_id, seed=3)
    b = engine.generate(prompts, sp, n=4, group_offset=10)
    validate(b, single_version=True)
    assert b["group_id"].tolist() == [g for g in (10, 11, 12) for _ in range(4)]
    # prompts are reproduced verbatim at the start of each row (token-first, right-padded)
    for i, p in enumerate(prompts):
        for j in range(4):
            assert b["tokens"][4 * i + j, : len(p)].tolist() == p
    d = (_fresh_logprobs(engine.model, b, temperature) - b["rollout_logprobs"])[b["action_mask"]].abs().max()
    assert float(d) < 1e-5


def test_eos_is_an_action_and_stops(engine):
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, eos_id=TOK.eos_token_id, seed=0)
    b = engine.generate([TOK.encode("5")] * 16, sp)
    for row in range(16):
        acts = b["tokens"][row][b["action_mask"][row]].tolist()
        if TOK.eos_token_id in acts:
            assert acts.index(TOK.eos_token_id) == len(acts) - 1  # EOS included once, nothing after


def test_seeded_sampling_is_reproducible(engine):
    sp = SamplingParams(max_new_tokens=6, seed=5, eos_id=TOK.eos_token_id)
    a = engine.generate([TOK.encode("9")], sp, n=3)
    b = engine.generate([TOK.encode("9")], sp, n=3)
    assert torch.equal(a["tokens"], b["tokens"])


def test_top_k_top_p_logprobs_are_of_the_sampled_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    z = filter_logits(logits, 1.0, top_k=2, top_p=1.0)
    p = torch.softmax(z, -1)
    assert p[0, 2] == 0 and p[0, 3] == 0 and abs(float(p.sum()) - 1) < 1e-6
    # top-p 0.7: probs ≈ [.61, .22, .14, .03] -> keep the first two (mass before #2 is .61 < .7)
    z = filter_logits(logits, 1.0, top_k=0, top_p=0.7)
    assert torch.isinf(z[0, 2:]).all() and torch.isfinite(z[0, :2]).all()
    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=1))
    b = eng.generate([TOK.encode("1")] * 8, SamplingParams(max_new_tokens=8, top_k=5, top_p=0.9, seed=0))
    # returned log-probs are renormalised over the kept set, so ≥ the untruncated ones
    fresh = _fresh_logprobs(eng.model, b, 1.0)
    m = b["action_mask"]
    assert (b["rollout_logprobs"][m] >= fresh[m] - 1e-6).all()


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_load_weights_transaction_and_fault_mid_publication():
    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=2))
    v0 = eng.state_dict()
    new = {k: v + 0.01 for k, v in v0.items()}

    def failing():
        for i, (k, v) in enumerate(new.items()):
            if i == 3:
                raise ConnectionError("trainer died")
            yield k, v

    with pytest.raises(WeightPublishError, match="failed after 3 tensors.*still serving version 0"):
        eng.load_weights(failing(), version=1)
    assert eng.policy_version == 0
    assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in v0.items())  # no mixed weights
    with pytest.raises(WeightPublishError, match="incomplete publication"):
        eng.load_weights(dict(list(new.items())[:2]), version=1)
    bad = dict(new)
    first = next(iter(bad))
    bad[first] = bad[first].clone().fill_(float("nan"))
    with pytest.raises(WeightPublishError, match="NaN"):
        eng.load_weights(bad, version=1)
    with pytest.raises(WeightPublishError, match="unknown parameters"):
        eng.load_weights({**new, "extra.weight": torch.zeros(1)}, version=1)
    eng.load_weights(new, version=1)
    assert eng.policy_version == 1
    assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in new.items())
    with pytest.raises(WeightPublishError, match="greater than the serving version 1"):
        eng.load_weights(new, version=1)
    # after publishing V+1, sampled-token log-probs match a forward pass of V+1's weights
    b = eng.generate([TOK.encode("2+2=")], SamplingParams(max_new_tokens=8, seed=1), n=4)
    assert b["policy_version"].tolist() == [1] * 4
    d = (_fresh_logprobs(eng.model, b, 1.0) - b["rollout_logprobs"])[b["action_mask"]].abs().max()
    assert float(d) < 1e-5


def test_staged_transaction_begin_stage_commit():
    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=2))
    v0 = eng.state_dict()
    new = {k: v + 0.01 for k, v in v0.items() if k != "lm_head.weight"}  # tied: the alias is filled
    names = list(new)
    with pytest.raises(WeightPublishError, match="without begin"):
        eng.stage(new)
    eng.begin(1)
    with pytest.raises(WeightPublishError, match="still being staged"):
        eng.begin(2)
    eng.stage({k: new[k] for k in names[:3]})  # pieces arrive in several calls
    assert eng.policy_version == 0 and all(torch.equal(eng.model.state_dict()[k], v) for k, v in v0.items())
    with pytest.raises(WeightPublishError, match="staged twice"):
        eng.stage({names[0]: new[names[0]]})
    assert eng._txn is None  # a refused piece aborts the publication
    eng.begin(1)
    eng.stage({k: new[k] for k in names[:3]})
    eng.stage({k: new[k] for k in names[3:]})
    eng.commit()
    assert eng.policy_version == 1
    assert torch.equal(eng.model.state_dict()["lm_head.weight"], new["model.embed_tokens.weight"])
    eng.begin(2)
    eng.stage({names[0]: new[names[0]]})
    eng.abort()
    with pytest.raises(WeightPublishError, match="without begin"):
        eng.commit()
    assert eng.policy_version == 1


def test_shared_engine_serves_the_policy_itself_and_fails_closed():
    policy = tiny_qwen3(TOK.vocab_size, seed=2)
    policy.train()
    eng = TransformersEngine(policy, shared=True)
    assert eng.model is policy
    eng.generate([TOK.encode("2+2=")], SamplingParams(max_new_tokens=4, seed=1), n=2)
    assert policy.training  # the generation ran in eval mode and restored train mode
    with torch.no_grad():
        next(policy.parameters()).add_(0.5)  # the optimizer's in-place update
    eng.load_weights(dict(policy.named_parameters()), version=1)  # a checked version bump, no copy
    b = eng.generate([TOK.encode("2+2=")], SamplingParams(max_new_tokens=4, seed=1), n=2)
    assert b["policy_version"].tolist() == [1, 1]
    d = (_fresh_logprobs(policy, b, 1.0) - b["rollout_logprobs"])[b["action_mask"]].abs().max()
    assert float(d) < 1e-5
    with torch.no_grad():
        next(policy.parameters()).fill_(float("nan"))
    with pytest.raises(WeightPublishError, match="NaN"):
        eng.load_weights(dict(policy.named_parameters()), version=2)
    assert eng.policy_version == 1
    with pytest.raises(WeightPublishError, match="fails closed"):  # V's weights are gone: no generation
        eng.generate([TOK.encode("2+2=")], SamplingParams(max_new_tokens=4, seed=1))


@pytest.mark.slow
def test_engines_stamp_versions_and_finish_reasons():
    tok = TOK
    eng = TransformersEngine(tiny_qwen3(tok.vocab_size, seed=0), version=3)
    b = eng.generate([tok.encode("1+2="), tok.encode("30+4=")], SamplingParams(max_new_tokens=6, temperature=1.0,
                                                                              eos_id=tok.eos_token_id, seed=0), n=4)
    act = b["action_mask"]
    assert bool((b["token_version"][act] == 3).all()) and bool((b["token_version"][b["attention_mask"] & ~act]
                                                                == -1).all())
    last = b["tokens"].gather(1, (b["attention_mask"].sum(-1) - 1)[:, None])[:, 0]
    # stop exactly when the row's last token is EOS; otherwise it used its 6 tokens ("length")
    assert b["finish_reason"].tolist() == [0 if int(t) == tok.eos_token_id else 1 for t in last]
    assert all(int(n) == 6 for n, f in zip(act.sum(-1), b["finish_reason"]) if int(f) == 1)
    validate(b, learner_version=3, max_staleness=0)


def test_the_engines_kv_cache_and_grouped_attention_give_transformers_own_tokens_and_logprobs():
    """The engine's decode (grouped K/V straight to SDPA, a KV cache written in place) against the same model
    under transformers' own ``sdpa`` attention and ``DynamicCache``: the same sampled tokens and the same
    log-probs bit for bit, over prompts of several lengths (left padding), a group's shared prefill, rows that
    stop early (the cache shrinks) and a generation longer than the planned capacity (the buffers grow)."""
    import copy

    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams, TransformersEngine
    from hyperrl.rollout import hf as hf_mod

    model = tiny_qwen3(40, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, stop_ids=(7,))
    new = TransformersEngine(copy.deepcopy(model), decode="model")  # the model's forward (the own step: test_decode)
    assert new.model.config._attn_implementation == "hyperrl_gqa_sdpa"
    ref = TransformersEngine(copy.deepcopy(model), decode="model")
    for m in ref.model.modules():  # back to transformers' own attention and cache
        if getattr(m, "config", None) is not None:
            m.config._attn_implementation = "sdpa"
    ref._cache = lambda capacity: None
    a, b = new.generate(prompts, sp, n=3), ref.generate(prompts, sp, n=3)
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["rollout_logprobs"], b["rollout_logprobs"])
    assert len(set(a["action_mask"].sum(-1).tolist())) > 1  # some rows stopped early
    small = TransformersEngine(copy.deepcopy(model), decode="model")
    small._cache = lambda capacity: hf_mod.preallocated_cache(4)  # smaller than the prompt + 12 tokens: grows
    c = small.generate(prompts, sp, n=3)
    assert torch.equal(a["tokens"], c["tokens"]) and torch.equal(a["rollout_logprobs"], c["rollout_logprobs"])
