"""The loop's four seams, each tested without building a trainer: Learner, data-parallel strategy,
Publisher, Checkpointer — and the recipe pipeline."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import hyperrl.transforms as T
from hyperrl.config import load_config
from hyperrl.distributed.strategy import LocalParallel
from hyperrl.loop.checkpointer import Checkpointer
from hyperrl.loop.learner import Learner, Optimized
from hyperrl.loop.pipeline import build_pipeline
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rollout import TransformersEngine, WeightPublishError
from hyperrl.rollout.publisher import IdentityExecutor, Publisher
from hyperrl.trajectory import cat_batches, make_trajectory
from tests.dist_helpers import run_gloo


def _batch(B=6, T_=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T_ + 1, (B,), generator=g)
    attn = torch.arange(T_)[None, :] < lengths[:, None]
    act = attn & (torch.arange(T_)[None, :] >= 1)
    return make_trajectory(tokens=torch.randint(0, 7, (B, T_), generator=g), attention_mask=attn, action_mask=act,
                           rollout_logprobs=torch.zeros(B, T_), policy_version=torch.zeros(B, dtype=torch.long),
                           group_id=torch.arange(B) // 2, reward=torch.randn(B, generator=g),
                           advantages=torch.randn(B, T_, generator=g))


class _Linear(torch.nn.Module):
    """A per-token "policy": lp = w[token] (any differentiable function of the batch will do)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 7))


def _loss_fn(model):
    def loss(part, norm):
        lp = model.w[part["tokens"]]
        return T.LossOutput({"loss_policy": T.aggregate(-part["advantages"] * lp, part["action_mask"], "token-mean",
                                                        num_tokens=norm.num_tokens)},
                            {"rows": torch.tensor(float(part.batch_size[0]))})
    return loss


def _learner(model, **kw):
    return Learner({"policy": Optimized(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.1)}, grad_clip=1e9, **kw)


@settings(max_examples=20, deadline=None)
@given(budget=st.integers(0, 30), seed=st.integers(0, 100))
def test_micro_batching_under_the_global_normaliser_equals_the_full_batch(budget, seed):
    b = _batch(seed=seed)
    a, c = _Linear(), _Linear()
    ma = _learner(a).update(b, _loss_fn(a))
    widths = []
    loss_c = _loss_fn(c)
    mc = _learner(c).update(b, lambda p, n: widths.append((p["tokens"].shape[1], p["attention_mask"].sum(-1).max()))
                            or loss_c(p, n), micro_batch_tokens=budget)
    assert all(w == int(longest) for w, longest in widths)  # every micro-batch cut to its own longest row
    assert torch.allclose(a.w, c.w, atol=1e-6)
    assert ma["loss_policy"] == pytest.approx(mc["loss_policy"], abs=1e-6)  # weighted by rows: the same mean


def test_zero_weight_passes_change_nothing_and_make_the_same_calls():
    class Padding(LocalParallel):  # a strategy whose other rank has two more micro-batches
        def pad_micro_batches(self, micros):
            return micros + [None, None]

    b = _batch()
    a, c = _Linear(), _Linear()
    calls = []
    loss = _loss_fn(c)
    _learner(a).update(b, _loss_fn(a), micro_batch_tokens=8)
    _learner(c, parallel=Padding()).update(b, lambda p, n: calls.append(p.batch_size[0]) or loss(p, n),
                                           micro_batch_tokens=8)
    assert torch.equal(a.w, c.w) and calls[-2:] == [1, 1]


def test_schedule_and_two_modules_step_together():
    a, crit = _Linear(), _Linear()
    lr = Learner({"policy": Optimized(a, torch.optim.SGD(a.parameters(), lr=1.0), 1.0),
                  "critic": Optimized(crit, torch.optim.SGD(crit.parameters(), lr=0.5), 0.5)},
                 grad_clip=1e9, schedule="linear", total_steps=3, warmup=0)
    before = crit.w.detach().clone()

    def loss(part, norm):
        return _loss_fn(a)(part, norm) + T.LossOutput({"loss_value": (crit.w ** 2).sum()})

    lrs = [lr.update(_batch(), loss, mini_batches=1)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([1.0, 0.5, 0.0]) and lr.optim_steps == 3
    assert lr.modules["critic"].optimizer.param_groups[0]["lr"] == 0.0  # the same multiplier, its own base
    assert not torch.equal(before, crit.w)


def test_loss_output_sum_refuses_a_name_twice():
    a = T.LossOutput({"loss_policy": torch.tensor(1.0)}, {"m": torch.tensor(0.0)})
    assert float((a + T.LossOutput({"loss_value": torch.tensor(2.0)})).loss) == 3.0
    with pytest.raises(ValueError, match="term 'loss_policy' is in both"):
        a + a


def _dp_worker(rank, world):
    from hyperrl.distributed.strategy import make_parallel

    p = make_parallel()
    norm = p.global_normalizer(T.Normalizer(torch.tensor(3.0 + rank), torch.tensor(1.0), 4.0))
    micros = p.pad_micro_batches([[0]] * (rank + 1))
    agree = p.agree_forward()
    return {"kind": type(p).__name__, "norm": (float(norm.num_tokens), float(norm.num_seqs), norm.length_const),
            "micros": len(micros), "none": micros.count(None), "agree": agree(rank == 0, 3 + rank),
            "rows": p.all_have_rows(rank), "metrics": p.mean_metrics({"a": 1.0 + rank, **({"b": 5.0} if rank else {}),
                                                                      "step": 7}),
            "shard": p.shard(list(range(5)))}


@pytest.mark.dist
def test_data_parallel_rules_on_two_gloo_processes():
    r = run_gloo(_dp_worker, 2)
    assert r[0]["kind"] == "TorchParallel"
    assert r[0]["norm"] == r[1]["norm"] == (7.0, 2.0, 4.0)  # summed over ranks, the constant kept
    assert r[0]["micros"] == r[1]["micros"] == 2 and (r[0]["none"], r[1]["none"]) == (1, 0)
    assert r[0]["agree"] == r[1]["agree"] == (False, 4)  # shared only if all prefer it; the largest S
    assert r[0]["rows"] is r[1]["rows"] is False  # rank 0 has no rows: every rank skips
    assert r[0]["metrics"] == r[1]["metrics"] == {"a": 1.5, "b": 5.0, "step": 7}  # b: over the ranks that have it
    assert (r[0]["shard"], r[1]["shard"]) == ([0, 2, 4], [1, 3])


def test_local_parallel_is_the_identity():
    p = LocalParallel()
    n = T.Normalizer(torch.tensor(3.0), torch.tensor(1.0))
    assert p.global_normalizer(n) is n and p.pad_micro_batches([[0]]) == [[0]] and p.agree_forward() is None
    assert p.all_have_rows(1) and not p.all_have_rows(0) and p.loss_scale == 1.0 and p.shard([1, 2]) == [1, 2]


def test_publisher_hands_views_and_keeps_v_on_failure():
    policy = tiny_qwen3(11, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, seed=1)
    engine = TransformersEngine(copy.deepcopy(policy))
    pub = Publisher.for_engine(policy, engine)
    assert isinstance(pub.executor, IdentityExecutor)
    sent = pub.gather(policy)
    assert all(sent[k].data_ptr() == p.data_ptr() for k, p in policy.named_parameters())  # no staging copy
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    pub.publish(policy, 1)
    assert engine.policy_version == 1
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in policy.state_dict().items())
    with torch.no_grad():
        next(policy.parameters()).fill_(float("nan"))
    with pytest.raises(WeightPublishError, match="NaN"):
        pub.publish(policy, 2)
    assert engine.policy_version == 1 and torch.isfinite(next(engine.model.parameters())).all()


def test_publisher_casts_at_the_source_and_fails_closed_when_the_executor_dies():
    policy = tiny_qwen3(11, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, seed=1)
    engine = TransformersEngine(copy.deepcopy(policy).to(torch.bfloat16))
    pub = Publisher.for_engine(policy, engine)
    assert {pl.dtype for pl in pub.src.values()} == {torch.bfloat16}  # the wire carries the engine's dtype
    assert pub.plan.stats().local_bytes == sum(p.numel() * 2 for p in policy.parameters())
    before = engine.state_dict()

    class Dying:
        def __call__(self, plan, rank, shards):
            raise ConnectionError("peer 3 went away")

    pub.executor = Dying()
    with pytest.raises(WeightPublishError, match="failed in Dying.*peer 3 went away.*still serving version 0"):
        pub.publish(policy, 1)
    assert engine.policy_version == 0 and engine._txn is None  # aborted: the next publication may begin
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    pub.executor = IdentityExecutor()
    pub.publish(policy, 1)
    assert engine.policy_version == 1
    assert all(torch.equal(engine.model.state_dict()[k], v.to(torch.bfloat16)) for k, v in policy.state_dict().items())


def test_layouts_that_do_not_match_are_refused_at_construction_with_names():
    from hyperrl.sharding import LayoutError

    policy = tiny_qwen3(11, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, seed=1)
    other = tiny_qwen3(11, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=64, seed=1)
    with pytest.raises(LayoutError, match=r"shape mismatch: .*model.layers.0.mlp.down_proj.weight: source \[16, 32\] "
                                          r"vs destination \[16, 64\]"):
        Publisher.for_engine(policy, TransformersEngine(other))


def test_checkpointer_round_trips_module_and_optimizer(tmp_path):
    m = _Linear()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    _learner_step = Learner({"policy": Optimized(m, opt, 0.1)}, grad_clip=1e9)
    _learner_step.update(_batch(), _loss_fn(m))
    ck = Checkpointer(tmp_path)
    path = ck.save(1, {"model": (m, "optim", opt)}, {"step": 1})
    m2 = _Linear()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    assert ck.latest() == path and ck.load(path, {"model": (m2, "optim", opt2)})["step"] == 1
    assert torch.equal(m.w, m2.w)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    from hyperrl.loop.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no 'critic' part"):
        ck.load(path, {"model": (m2, "optim", opt2), "critic": (m2, "critic_optim", opt2)})


def test_dapo_pipeline_is_shaping_then_filter_then_advantages():
    cfg = load_config(None, ["--algo.recipe=dapo", "--rollout.max_new_tokens=4", "--algo.shaping=[{name: overlong, "
                             "buffer: 2}]"])
    p = build_pipeline(cfg.algo)
    # lengths 1..4 action tokens; budget 4, buffer 2: penalty (2 − |y|)/2 for |y| in (2, 4]
    b = _batch().exclude("advantages")
    shaped = p.shape(b)
    y = b["action_mask"].sum(-1).float()
    want = torch.where(y <= 2, 0.0, (2 - y) / 2)
    assert torch.allclose(shaped["reward"] - b["reward"], want)
    const = shaped.copy().set("reward", torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]))
    kept, dropped = p.filter(const)
    assert dropped == 4 and kept["group_id"].tolist() == [1, 1]  # groups 0 and 2 are constant
    out = p.transform(kept)
    ref = T.compute_advantages(kept, "grpo")
    assert torch.equal(out["advantages"], ref["advantages"]) and "advantages" not in kept.keys()


def test_cat_batches_pads_token_fields():
    a, b = _batch(2, 3), _batch(3, 5, seed=1)
    c = cat_batches([a, b])
    assert c["tokens"].shape == (5, 5) and not c["attention_mask"][:2, 3:].any()
    assert torch.equal(c["reward"], torch.cat([a["reward"], b["reward"]])) and cat_batches([a]) is a
    assert isinstance(c, TensorDict)


@settings(max_examples=15, deadline=None)
@given(budget=st.integers(1, 40), seed=st.integers(0, 50))
def test_no_grad_forwards_micro_batched_equal_the_whole_batch(budget, seed):
    from hyperrl.loop.forward import policy_logprobs
    from hyperrl.loop.learner import map_micro_batches

    model = tiny_qwen3(7, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, seed=seed)
    b = _batch(seed=seed)
    seen = []

    def fn(rows):  # each micro-batch arrives cut to its longest row: what it computes is rows × that width
        assert rows["tokens"].shape[1] == int(rows["attention_mask"].sum(-1).max())
        seen.append((rows["tokens"].numel(), int(rows["attention_mask"].sum())))
        return policy_logprobs(model, rows, 1.0, shared_prefix=False)

    with torch.no_grad():
        whole = policy_logprobs(model, b, 1.0, shared_prefix=False)
    lp, ent = map_micro_batches(fn, b, budget)
    m = b["action_mask"]
    assert torch.allclose(lp[m], whole[0][m], atol=1e-5) and torch.allclose(ent[m], whole[1][m], atol=1e-5)
    longest = int(b["attention_mask"].sum(-1).max())
    assert max(c for c, _ in seen) <= max(budget, longest) and sum(n for _, n in seen) == int(b["attention_mask"].sum())


def test_a_single_per_token_output_comes_back_as_one_tensor_at_full_width():
    # what the critic's values forward returns: one [b, w] tensor per micro-batch (not a tuple) → [B, T]
    from hyperrl.loop.learner import map_micro_batches

    b = _batch(B=8, T_=9, seed=3)
    out = map_micro_batches(lambda rows: rows["advantages"] * rows["attention_mask"], b, 12)
    assert isinstance(out, torch.Tensor) and out.shape == (8, 9)
    assert torch.equal(out, b["advantages"] * b["attention_mask"])


def test_one_process_publisher_fuses_into_an_engine_with_vllm_parameters():
    """A one-process publisher into vLLM's layout (fused qkv / gate_up, padded vocab) copies each
    slice into place (LocalExecutor), element-exact; a plain engine keeps the no-copy identity."""
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout.publisher import IdentityExecutor, LocalExecutor, Publisher, source_layout
    from hyperrl.sharding.models import from_hf_config
    from hyperrl.sharding.simulate import expected_destination
    from hyperrl.sharding.vllm import rollout_layout

    model = tiny_qwen3(100, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=48, seed=3)
    dst = rollout_layout(from_hf_config(model.config.to_dict()), tp=1, dp=1, dtype=torch.float32)
    pub = Publisher(source_layout(model, 1), dst)
    assert isinstance(pub.executor, LocalExecutor)
    got = pub.gather(model)
    want = expected_destination(dst, {k: v.detach() for k, v in model.state_dict().items()}, ranks=[0])[0]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert got["model.embed_tokens.weight"].shape == (128, 32) and not got["model.embed_tokens.weight"][100:].any()
    from hyperrl.rollout.hf import TransformersEngine

    assert isinstance(Publisher.for_engine(model, TransformersEngine(model)).executor, IdentityExecutor)
