"""The transformers engine's own decode step (hyperrl.rollout.decode) against the model's forward: the same tokens and
log-probs up to the attention's rounding, for every family it runs, through padding, early stops, finished rows
dropped, a cache that grows and a publication in the middle of a generation; and the models it must leave alone."""

import copy

import pytest
import torch

from hyperrl.models.tiny import tiny_qwen3, tiny_qwen3_moe
from hyperrl.rollout import SamplingParams, TransformersEngine
from hyperrl.rollout import hf as hf_mod
from hyperrl.rollout.decode import why_not
from hyperrl.rollout.requests import requests_for

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]


def _family(name: str) -> torch.nn.Module:
    """A random two-layer model of each family the own step runs, with its own quirks switched on: Qwen3's
    per-head norms, Qwen2's q/k/v biases, Llama's attention and MLP biases, Mistral's explicit head_dim."""
    import transformers as tf

    common = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if name == "qwen3":
        return tiny_qwen3(40, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96)
    if name == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, attention_bias=True, mlp_bias=True))
    else:
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, head_dim=16, sliding_window=None))
    with torch.no_grad():  # non-zero biases (they start at zero): the own step must add them
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def _pair(model):
    own, ref = TransformersEngine(copy.deepcopy(model)), TransformersEngine(copy.deepcopy(model), decode="model")
    return own, ref


def _close(a, b):
    """Same tokens, same masks; log-probs equal to the attention's rounding (fp32)."""
    assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["action_mask"], b["action_mask"])
    gap = (a["rollout_logprobs"] - b["rollout_logprobs"]).abs().max().item()
    assert gap < 1e-5, gap
    return gap


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_the_own_step_samples_what_the_models_forward_samples(family):
    """``decode=auto`` (the own step) vs ``decode=model`` (the model's forward every token): prompts of several
    lengths (left padding), a group's shared prefill, stop tokens (rows finish early), a cache smaller than planned
    (it grows), keyed requests whose finished rows are dropped from the batch halfway."""
    model = _family(family)
    own, ref = _pair(model)
    assert why_not(own.model) is None
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, seed=3, stop_ids=(7, 9))
    a, b = own.generate(PROMPTS, sp, n=3), ref.generate(PROMPTS, sp, n=3)
    assert own.decode_reason is None and ref.decode_reason == "decode=model"
    _close(a, b)
    assert len(set(a["action_mask"].sum(-1).tolist())) > 1  # some rows stopped early
    small = TransformersEngine(copy.deepcopy(model))
    small._cache = lambda capacity: hf_mod.preallocated_cache(4)  # smaller than prompt + 16 tokens: grows
    _close(small.generate(PROMPTS, sp, n=3), b)
    reqs = requests_for(PROMPTS, 2, uid_offset=100)
    _close(own.generate_requests(reqs, sp), ref.generate_requests(reqs, sp))


def test_the_own_steps_log_probs_are_a_fresh_forwards():
    """Each generated token's log-prob equals the model's full forward over the finished row (no cache at all)."""
    from hyperrl.transforms import sequence_logprobs

    model = _family("qwen3")
    own = TransformersEngine(copy.deepcopy(model))
    b = own.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=1), n=2)
    with torch.no_grad():
        logits = model(input_ids=b["tokens"], attention_mask=b["attention_mask"].long()).logits
    fresh = sequence_logprobs(logits, b["tokens"], 1.0)
    act = b["action_mask"]
    assert (fresh - b["rollout_logprobs"])[act].abs().max() < 1e-5


class _PublishAt:
    """A ``hold`` that publishes new weights (every parameter + 0.02, the per-head norms included) to ``engine``
    before decode step ``k``."""

    def __init__(self, engine, k):
        self.engine, self.k, self.calls = engine, k, 0

    def wait(self):
        self.calls += 1
        if self.calls == self.k:
            new = {n: v + 0.02 for n, v in self.engine.state_dict().items()}
            self.engine.load_weights(new, version=self.engine.policy_version + 1)


def test_a_publication_mid_generation_reaches_the_own_step():
    """A held publication replaces the weights between two decode steps: the own step takes them from there
    (its per-head norm weights, gathered per generation, included) — the model's forward under the same schedule
    gives the same tokens and log-probs; each token is stamped with the version that sampled it."""
    model = _family("qwen3")
    own, ref = _pair(model)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    reqs = requests_for(PROMPTS, 2, uid_offset=0)
    a = own.generate_requests(reqs, sp, hold=_PublishAt(own, 4))
    b = ref.generate_requests(reqs, sp, hold=_PublishAt(ref, 4))
    _close(a, b)
    assert set(a["token_version"][a["action_mask"]].tolist()) == {0, 1}
    plain = TransformersEngine(copy.deepcopy(model)).generate_requests(reqs, sp)  # no publication: differs
    assert (plain["rollout_logprobs"] - a["rollout_logprobs"]).abs().max() > 1e-3


def test_models_the_own_step_leaves_to_their_forward():
    """A mixture of experts, a bf16 model, a hooked module and a patched forward run the model's forward (the
    reason kept); ``decode=hyperrl`` refuses them by name; an unknown ``decode`` is refused."""
    moe = TransformersEngine(tiny_qwen3_moe(40, hidden=32, head_dim=16, layers=1))
    moe.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0))
    assert moe.decode_reason == "a mixture of experts or a vision model"
    assert "bfloat16" in why_not(tiny_qwen3(40, dtype=torch.bfloat16))
    hooked = TransformersEngine(_family("qwen3"))
    handle = hooked.model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o)
    hooked.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0))
    assert "'model.layers.1.mlp' is hooked" in hooked.decode_reason
    handle.remove()
    hooked.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0))
    assert hooked.decode_reason is None  # checked per generation
    patched = TransformersEngine(_family("qwen3"))
    patched.model.forward = patched.model.forward
    patched.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0))
    assert "forward replaced" in patched.decode_reason
    with pytest.raises(ValueError, match="decode=hyperrl.*mixture|decode=hyperrl.*qwen3_moe"):
        TransformersEngine(tiny_qwen3_moe(40, hidden=32, head_dim=16, layers=1), decode="hyperrl")
    with pytest.raises(ValueError, match="decode='fast'"):
        TransformersEngine(_family("qwen3"), decode="fast")


def test_the_engine_factory_takes_decode(tmp_path):
    """``rollout.engine.decode`` reaches the engine; a wrong value is refused at load naming the key."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.engine\.decode: 'fast'"):
        load_config(None, [f"--run.out_dir={tmp_path}", "--rollout.engine={name: transformers, decode: fast}"])
    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path}", "--rollout.engine={name: transformers, "
                                                                        "decode: model}"]))
    assert tr.generator.engine.decode == "model"


def test_the_rotary_table_is_the_models_rotary():
    """The own step's cos / sin looked up from a table equal the model's rotary module at those positions bit for
    bit (default and linear-scaled rotaries); a length-dependent rotary (dynamic) is called every step instead."""
    import transformers as tf

    from hyperrl.rollout.decode import DecodeStep

    for rope in ({"rope_type": "default", "rope_theta": 1e4}, {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                 {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}):
        cfg = tf.Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                             rope_parameters=rope)
        step = DecodeStep(tf.Qwen3ForCausalLM(cfg).eval())
        assert step._static_rope == (rope["rope_type"] != "dynamic")
        h, pos = torch.zeros(3, 32), torch.tensor([[0], [17], [200]])
        want = step.inner.rotary_emb(h, pos)
        got = step._rope(h, pos, 201)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_the_stacked_projection_is_the_three_bit_for_bit(family):
    """The own step's one q/k/v product (weights stacked once a build) gives the three projections' numbers exactly
    — at the test model's width and at the benchmarks' (the engine's generations are those of the three products);
    a projection without a bias beside ones with biases adds zeros."""
    from torch.nn import functional as F

    from hyperrl.rollout.decode import _stacked

    a = _family(family).model.layers[0].self_attn
    for x in (torch.randn(37, a.q_proj.in_features), torch.randn(128, a.q_proj.in_features)):
        w, b = _stacked(a.q_proj, a.k_proj, a.v_proj)
        assert (b is None) == (family == "qwen3")  # Qwen3 has no q/k/v biases; Qwen2 and this Llama have them
        assert torch.equal(F.linear(x, w, b), torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1))
    wide = [torch.nn.Linear(256, n, bias=False) for n in (256, 128, 128)]
    x = torch.randn(128, 256)
    assert torch.equal(F.linear(x, *_stacked(*wide)), torch.cat([m(x) for m in wide], -1))
    mixed = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 2, bias=False)]
    w, b = _stacked(*mixed)
    assert b[4:].eq(0).all() and torch.equal(b[:4], mixed[0].bias)
