"""Context parallelism by head exchange (Ulysses; issue 30, item 5 — the layer): on 2 and 4 real gloo
processes, each holding a contiguous slice of every sequence, a tiny Qwen3 (grouped-query attention: 4 query,
2 key/value heads) gives the same token log-probs and entropies as the whole sequence in one process, and —
the loss summed over the slices — the same gradient for every parameter."""

import pytest
import torch

from tests.dist_helpers import record_grads, run_gloo

pytestmark = pytest.mark.dist

B, T, V = 3, 13, 40


def _model():
    from hyperrl.models import tiny_qwen3

    return tiny_qwen3(V, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, seed=5)


def _data():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, V, (B, T), generator=g)
    lengths = torch.tensor([T, T - 4, T - 7])
    attn = torch.arange(T)[None] < lengths[:, None]
    tokens = torch.where(attn, tokens, 0)  # right-padded
    weights = torch.randn(B, T, generator=g)
    return tokens, attn, weights


def _lp_ent(logits, targets):
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _cp_worker(rank, world, attention="ulysses", heads=(4, 2)):
    import torch.distributed as dist

    from hyperrl.distributed.context_parallel import context_parallel, gather_sequence, layout_index, split_sequence
    from hyperrl.models import tiny_qwen3

    model = context_parallel(_model() if heads == (4, 2) else tiny_qwen3(
        V, hidden=32, layers=2, heads=heads[0], kv_heads=heads[1], head_dim=16, intermediate=64, seed=5),
        dist.group.WORLD, attention)
    layout = "contiguous" if attention == "ulysses" else "zigzag"
    tokens, attn, weights = _data()
    local, pos, Tp = split_sequence(tokens, dist.group.WORLD, layout=layout)
    mine = layout_index(Tp, world, layout)[rank]
    targets = torch.nn.functional.pad(tokens, (0, Tp + 1 - T))[:, mine + 1]
    logits = model(input_ids=local, position_ids=pos).logits  # [B, T'/cp, V]
    lp, ent = _lp_ent(logits, targets)
    lp_full, ent_full = (gather_sequence(x, dist.group.WORLD, T, layout) for x in (lp, ent))
    # the loss over this rank's slice; the slices' gradients sum to the whole sequence's
    mask = (torch.arange(Tp)[None] < attn.sum(-1, keepdim=True) - 1)[:, mine]
    w = torch.nn.functional.pad(weights, (0, Tp - T))[:, mine]
    (lp * w * mask).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g.numpy()
    return {"lp": lp_full.detach().numpy(), "ent": ent_full.detach().numpy(), "grads": grads}


@pytest.mark.parametrize("attention, cp, heads", [("ulysses", 4, (4, 2)), ("ring", 4, (2, 1))],
                         ids=["ulysses-cp4", "ring-cp4-past-the-heads"])
def test_cp_attention_equals_the_whole_sequence_in_one_process(attention, cp, heads):
    """Ulysses (cp 4: heads exchanged, past the 2 key/value heads — repeated; cp 2 in the trainer tests below) and
    ring attention at cp 4 on
    a model of 2 query heads and 1 key/value head — past both, which Ulysses refuses: the log-probs, entropies and
    every parameter's gradient of the whole sequence in one process."""
    res = run_gloo(_cp_worker, cp, attention, heads, timeout=300)
    from hyperrl.models import tiny_qwen3

    model = _model() if heads == (4, 2) else tiny_qwen3(V, hidden=32, layers=2, heads=heads[0], kv_heads=heads[1],
                                                        head_dim=16, intermediate=64, seed=5)
    tokens, attn, weights = _data()
    logits = model(input_ids=tokens, attention_mask=attn.long()).logits
    lp, ent = _lp_ent(logits[:, :-1], tokens[:, 1:])
    mask = torch.arange(T - 1)[None] < attn.sum(-1, keepdim=True) - 1  # real targets
    (lp * weights[:, :-1] * mask).sum().backward()
    gaps = {"lp": 0.0, "ent": 0.0, "grad": 0.0}
    for out in res.values():
        got_lp = torch.from_numpy(out["lp"])[:, :T - 1]
        got_ent = torch.from_numpy(out["ent"])[:, :T - 1]
        gaps["lp"] = max(gaps["lp"], float((got_lp - lp.detach())[mask].abs().max()))
        gaps["ent"] = max(gaps["ent"], float((got_ent - ent.detach())[mask].abs().max()))
        for name, p in model.named_parameters():
            g = torch.from_numpy(out["grads"][name])
            gaps["grad"] = max(gaps["grad"], float((g - p.grad).abs().max()) / float(p.grad.abs().max()))
    print(f"{attention} cp={cp} heads={heads}: max gaps {gaps}")
    assert gaps["lp"] < 1e-5 and gaps["ent"] < 1e-5 and gaps["grad"] < 1e-5


def _ring_cases_worker(rank, world):
    """Ring attention's kernel against SDPA with the same mask over random cases (one seed each, the same on every
    rank): grouped heads, odd lengths, packed segments, several query-row blocks; each rank its zigzag rows (and, for
    the flash path, contiguous ones) — by torch's CPU flash kernel per run pair and by the masked matmul path."""
    import torch.distributed as dist

    import hyperrl.distributed.ring_attention as ra
    from hyperrl.distributed.context_parallel import layout_index

    ra._ROWS = 3  # several row blocks per rank, some of them skipped (all keys after the queries)
    gaps = []
    for seed in range(24):
        ra._FLASH = seed < 12  # the first 12 cases by the flash kernel (the packed ones by the matmul path)
        g = torch.Generator().manual_seed(seed)
        B, hk = int(torch.randint(1, 3, (), generator=g)), int(torch.randint(1, 3, (), generator=g))
        h, D = hk * int(torch.randint(1, 4, (), generator=g)), 8
        S = 2 * world * int(torch.randint(1, 5, (), generator=g))
        q, dout = torch.randn(B, h, S, D, generator=g, dtype=torch.float64), torch.randn(B, h, S, D, generator=g)
        k, v = (torch.randn(B, hk, S, D, generator=g, dtype=torch.float64) for _ in range(2))
        seg = torch.randint(0, 3, (B, S), generator=g).sort(-1).values if seed % 2 else None
        idx = layout_index(S, world, "zigzag" if seed % 3 else "contiguous")
        mine = idx[rank]
        lq, lk, lv = (t[:, :, mine].detach().clone().requires_grad_() for t in (q, k, v))
        out = ra.ring_attention_kernel(lq, lk, lv, dist.group.WORLD, idx, seg)
        out.backward(dout[:, :, mine].to(out.dtype))
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        mask = torch.ones(S, S, dtype=torch.bool).tril()[None]
        if seg is not None:
            mask = mask & (seg[:, :, None] == seg[:, None, :])
        ref = torch.nn.functional.scaled_dot_product_attention(
            fq, fk.repeat_interleave(h // hk, 1), fv.repeat_interleave(h // hk, 1), attn_mask=mask[:, None])
        ref.backward(dout.to(ref.dtype))
        dk, dv = lk.grad.clone(), lv.grad.clone()
        out = out.detach()
        ref = ref.detach()
        gaps.append(max(float((out - ref[:, :, mine]).abs().max()), float((lq.grad - fq.grad[:, :, mine]).abs().max()),
                        float((dk - fk.grad[:, :, mine]).abs().max()), float((dv - fv.grad[:, :, mine]).abs().max())))
    return gaps


def test_ring_attention_kernel_equals_masked_attention_on_odd_rings():
    """3 ranks (an odd ring), 24 random cases in float64, each by the flash and the matmul path: outputs and the
    gradients of q, k, v of each rank's zigzag (or contiguous) rows equal SDPA's with the causal (and packed-segment)
    mask over the whole sequence."""
    res = run_gloo(_ring_cases_worker, 3, timeout=240)
    worst = max(max(g) for g in res.values())
    print(f"ring kernel: max gap {worst:.2e}")
    assert worst < 1e-10


def test_zigzag_layout_gives_each_rank_equal_causal_work_and_gathers_back():
    """The load-balanced split: rank r holds chunks r and 2·cp − 1 − r, every position exactly once, and the causal
    pairs (query, key ≤ query) each rank's queries cover are equal across ranks."""
    from hyperrl.distributed.context_parallel import layout_index

    for cp, total in ((2, 8), (3, 12), (4, 32)):
        idx = layout_index(total, cp, "zigzag")
        assert sorted(idx.flatten().tolist()) == list(range(total))
        work = [int((i + 1).sum()) for i in idx]  # query at position p sees p + 1 keys
        assert len(set(work)) == 1, work
        c = total // (2 * cp)
        assert idx[0, :c].tolist() == list(range(c)) and idx[0, c:].tolist() == list(range(total - c, total))
    with pytest.raises(ValueError, match="do not cut into 4 ranks' zigzag slices"):
        layout_index(12, 4, "zigzag")


def _moe_batch():
    from tensordict import TensorDict

    tokens, attn, _ = _data()
    act = attn & (torch.arange(T)[None] >= 4)
    return TensorDict({"tokens": tokens, "attention_mask": attn.long(), "action_mask": act}, batch_size=[B])


def _moe_worker(rank, world):
    """The captured routes and the router tap's tokens of a CP forward (each rank its slice), merged over the ranks —
    under each attention, padded and packed."""
    import torch.distributed as dist

    from hyperrl.distributed.context_parallel import context_parallel
    from hyperrl.loop.forward import RouteReplay, context_parallel_logprobs_and_entropy
    from hyperrl.models import RouterTap, Routing, tiny_qwen3_moe

    out = {}
    for attention, packed in (("ulysses", False), ("ulysses", True), ("ring", False), ("ring", True)):
        model = context_parallel(tiny_qwen3_moe(V, experts=4, seed=3), dist.group.WORLD, attention)
        routing = Routing(model)
        replay = RouteReplay(routing, _moe_batch())
        with RouterTap(model) as tap:
            lp, _ = context_parallel_logprobs_and_entropy(model, _moe_batch(), 1.0, dist.group.WORLD, packed=packed,
                                                          replay=replay)
        out[attention, packed] = {"captured": replay.captured.numpy(), "lp": lp.detach().numpy(),
                                  "tapped": int(tap.mask.sum()), "counted": int(routing.counted)}
    return out


def test_a_mixtures_routes_are_sliced_with_the_sequence_and_merged():
    """A Qwen3-MoE on 2 gloo ranks (padded and packed, Ulysses and ring's zigzag rows): every rank's merged capture
    equals one process's plain forward's routes at every token it ran, −1 elsewhere; the log-probs equal; the router
    tap marked exactly the real tokens of the slice (their sum over ranks = the one-process forward's)."""
    from hyperrl.loop.forward import RouteReplay, plain_logprobs_and_entropy
    from hyperrl.models import RouterTap, Routing, tiny_qwen3_moe

    res = run_gloo(_moe_worker, 2, timeout=240)
    model = tiny_qwen3_moe(V, experts=4, seed=3)
    replay = RouteReplay(Routing(model), _moe_batch())
    with RouterTap(model):
        lp, _ = plain_logprobs_and_entropy(model, _moe_batch(), 1.0, replay)
    want = replay.captured
    assert int((want >= 0).all(-1).all(-1).sum()) == int(_moe_batch()["attention_mask"][:, :-1].sum())
    for attention, packed in (("ulysses", False), ("ulysses", True), ("ring", False), ("ring", True)):
        for rank in (0, 1):
            got = res[rank][attention, packed]
            assert torch.equal(torch.from_numpy(got["captured"])[:, :-1], want[:, :-1])
            act = _moe_batch()["action_mask"]
            assert float((torch.from_numpy(got["lp"]) - lp.detach())[act].abs().max()) < 1e-5
        # the padded forward runs each row's T − 1 first positions, the packed one every real token
        attn = _moe_batch()["attention_mask"]
        real = attn.sum() - (0 if packed else int(attn[:, -1].sum()))
        assert res[0][attention, packed]["tapped"] + res[1][attention, packed]["tapped"] == int(real)
        assert res[0][attention, packed]["counted"] == 0  # no reference routes: nothing compared


def _heads_worker(rank, world):
    import torch.distributed as dist

    from hyperrl.distributed.context_parallel import context_parallel, split_sequence
    from hyperrl.models import tiny_qwen3

    model = context_parallel(tiny_qwen3(V, hidden=32, layers=1, heads=1, kv_heads=1, head_dim=16, seed=1),
                             dist.group.WORLD)
    said = []
    local, pos, _ = split_sequence(_data()[0], dist.group.WORLD)
    try:
        model(input_ids=local, position_ids=pos)
        said.append("accepted")
    except ValueError as e:
        said.append(str(e))
    try:
        split_sequence(_data()[0][:, :3], dist.group.WORLD, layout="zigzag")
        said.append("accepted")
    except ValueError as e:
        said.append(str(e))
    return said


def test_cp_that_does_not_divide_the_heads_and_a_sequence_shorter_than_the_ring_are_refused():
    said = run_gloo(_heads_worker, 2, timeout=120)[0]
    assert said[0] == "run.cp=2: must divide the attention heads (1) — Ulysses splits heads over ranks; " \
                      "run.cp_attention=ring takes any cp"
    assert said[1] == "a sequence of 3 tokens is shorter than ring attention's 4 blocks (2 × run.cp=2): some rank " \
                      "would hold padding only; lower run.cp or use run.cp_attention=ulysses"


# ---------------------------------------------------------------- the trainer with run.cp (the embedded default)

ARGS = ["--rollout.prompts_per_step=8", "--rollout.n=8", "--run.eval_every=0", "--run.threads=1"]


def _trainer(out_dir, extra):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    return build_trainer(load_config(None, [f"--run.out_dir={out_dir}", *ARGS, *extra]))


def _grad_worker(rank, world, out_dir, extra):
    tr = _trainer(out_dir, extra)
    seen = record_grads(tr)
    m = tr.step()
    return {"grads": {k: v.numpy() for k, v in seen.items()}, "reward": m["reward_mean"],
            "rows": tr.parallel.shard(list(range(8))), "loss": m["loss_policy"]}


@pytest.mark.parametrize("cp, extra", [(4, ["--model.experts=4", "--algo.routing_replay=r2",
                                            "--optim.shared_prefix=false"]),
                                       (4, ["--algo.kl.coef=0.01", "--optim.micro_batch_tokens=256",
                                            "--algo.advantage=gae"]),
                                       (2, ["--optim.fused_head=on", "TEACHER", "--algo.distill.coef=1.0",
                                            "--optim.pack_tokens=4096", "--model.lora={r: 4}"]),
                                       (4, ["--run.cp_attention=ring", "--model.gradient_checkpointing=true",
                                            "--optim.pack_tokens=4096"]),
                                       (2, ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}"])],
                         ids=["cp4-moe-replay", "cp4-reference-micro-critic", "cp2xdp2-fused-head-teacher-packed-lora",
                              "cp4-ring-checkpointing-packed", "cp2xtp2"])
def test_the_cp_trainers_gradient_is_the_one_process_full_batch_gradient(tmp_path, cp, extra):
    """4 processes, each cp group a slice of every sequence of its rows (cp = 4: one group, all 64 rows; cp = 2:
    two groups of 32): the synced gradient equals one process's over the same 64 rows (keyed sampling), on every
    rank (the policy's and a critic's) —

    * a mixture of experts with routing replay (R2: the old pass's routes, each rank capturing its slice's tokens,
      merged, then replayed by the update; the load-balancing term over the gathered router logits — one cp group,
      so the term's token set is the one process's: the term is not linear in its tokens, and data-parallel shares
      take it per share with or without CP);
    * a reference model's KL, micro-batches and a critic (GAE: its values sliced as the log-probs; its gradient
      compared too);
    * the fused LM head (whose one-process gradient equals the unfused one's: tests/loop/test_fused_head.py), a
      distillation teacher (its log-probs sliced as the policy's: the advantages, hence the gradient, depend on
      them), packed rows and LoRA adapters;
    * ring attention (zigzag rows, keys and values passed round the 4 ranks) with gradient checkpointing (the ring
      replayed in recompute) on a packed sequence (attention within each row);
    * tensor parallelism (cp 2 × tp 2: a TP rank's 2 heads exchanged over its CP group — the ranks at its TP
      coordinate — all 4 training the same rows)."""
    if "TEACHER" in extra:
        from tests.loop.test_distill import _teacher

        extra = [f"--algo.distill.teacher={_teacher(tmp_path / 'teacher', seed=7, sharp=2.0)}",
                 *[e for e in extra if e != "TEACHER"]]
    res = run_gloo(_grad_worker, 4, str(tmp_path / "cp"), ["--run.cp=" + str(cp), *extra], timeout=600)
    tr = _trainer(str(tmp_path / "one"), [e for e in extra if not e.startswith(("--run.tp", "--rollout.engine"))])
    one = record_grads(tr)
    m = tr.step()
    tp = 2 if "--run.tp=2" in extra else 1
    assert [res[r]["rows"] for r in range(4)] == ([list(range(8))] * 4 if cp * tp == 4 else
                                                  [[0, 2, 4, 6]] * 2 + [[1, 3, 5, 7]] * 2)
    assert abs(res[0]["reward"] - m["reward_mean"]) < 1e-6 and abs(res[0]["loss"] - m["loss_policy"]) < 1e-5
    assert set(res[0]["grads"]) == set(one) and len(one) > 10
    if "--algo.advantage=gae" in extra:  # the critic's head gradient Σ (v − R)·h reads the CP forward's hidden states
        assert float(one["critic.head.weight"].abs().max()) > 0
    # (LoRA's A matrices get no gradient at the first step — B starts at 0 — : an absolute gap there)
    gap = max(float((torch.from_numpy(res[0]["grads"][k]) - v).abs().max()) / (float(v.abs().max()) or 1.0)
              for k, v in one.items())
    print(f"cp={cp} {extra}: max relative gradient gap {gap:.2e}")
    assert gap < 1e-5
    assert all((res[r]["grads"][k] == res[0]["grads"][k]).all() for r in res for k in one)  # every rank alike


@pytest.mark.parametrize("over, msg", [
    (["--run.cp=3"], r"run.cp=3 does not divide the world size 4"),
    (["--run.cp=4", "--model.heads=2", "--model.kv_heads=1"], r"run.cp=4 does not divide model.heads=2"),
    (["--run.cp=2", "--run.tp=2", "--run.ep=2", "--model.experts=4", "--rollout.engine={name: transformers, tp: 2}"],
     r"run.cp=2 with both run.tp=2 and run.ep=2: context parallelism composes with one of them"),
    (["--run.cp=4", "--run.tp=2", "--rollout.engine={name: transformers, tp: 2}"],
     r"run.cp=4 × run.tp=2 = 8 ranks a block does not divide the world size 4"),
    (["--run.cp=2", "--run.tp=2", "--model.heads=2", "--model.kv_heads=2",
      "--rollout.engine={name: transformers, tp: 2}"],
     r"run.cp=2 does not divide model.heads=2 \(1 a rank under run.tp=2\)"),
])
def test_bad_cp_settings_are_refused_at_load(over, msg, monkeypatch):
    from hyperrl.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "4")  # the world torchrun would give
    with pytest.raises(ConfigError, match=msg):
        load_config(None, over)


def test_ring_attention_takes_a_cp_past_the_heads_and_ulysses_past_the_kv_heads_warns(tmp_path, monkeypatch):
    """cp = 4 on 2 query heads: refused for Ulysses (naming ring), accepted for ring; Ulysses at cp 4 over 2 key/value
    heads (the default tiny model's) is accepted with a warning naming ring, once the model is built."""
    from types import SimpleNamespace

    from hyperrl.config import ConfigError, load_config
    from hyperrl.config.built import check_built
    from hyperrl.data.tasks import TaskLimits
    from hyperrl.distributed import ParallelDims
    from hyperrl.models import tiny_qwen3

    monkeypatch.setenv("WORLD_SIZE", "4")
    small = ["--run.cp=4", "--model.heads=2", "--model.kv_heads=1"]
    with pytest.raises(ConfigError, match="set run.cp_attention=ring"):
        load_config(None, small)
    assert load_config(None, [*small, "--run.cp_attention=ring"]).run.cp_attention == "ring"
    with pytest.raises(ConfigError, match="cp_attention"):
        load_config(None, ["--run.cp_attention=rings"])
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--run.cp=4"])
    task = SimpleNamespace(limits=lambda: TaskLimits(longest_prompt=6))
    model = tiny_qwen3(40, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=16, seed=1)
    with pytest.warns(RuntimeWarning, match=r"goes past the key/value heads .*run.cp_attention=ring exchanges"):
        check_built(cfg, task=task, policy=model, dims=ParallelDims(world=4, cp=4))
    two = tiny_qwen3(40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=1)
    check_built(cfg, task=task, policy=two, dims=ParallelDims(world=4, cp=4, cp_attention="ring"))  # accepted


def test_a_family_without_a_cp_plan_and_a_checkpoint_whose_heads_cp_does_not_divide_are_refused_at_build(tmp_path):
    """The post-build check (``check_built``, before any parallelism is applied) reads the built policy: cp = 4 over
    four ranks refuses a family whose attention is its own code and a checkpoint of 2 heads; accepts 4 heads."""
    from types import SimpleNamespace

    from hyperrl.config import ConfigError, load_config
    from hyperrl.config.built import check_built
    from hyperrl.data.tasks import TaskLimits
    from hyperrl.distributed import ParallelDims
    from hyperrl.models import tiny_qwen3

    cfg = load_config(None, [f"--run.out_dir={tmp_path}"])
    task = SimpleNamespace(limits=lambda: TaskLimits(longest_prompt=6))  # what the check reads of a task
    dims = ParallelDims(world=4, cp=4)
    said = []
    own = tiny_qwen3(40, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=16, seed=1)
    own._supports_attention_backend = False  # a family whose attention is its own code: no CP plan
    for model in (own, tiny_qwen3(40, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=1),
                  tiny_qwen3(40, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=16, seed=1)):
        try:
            check_built(cfg, task=task, policy=model, dims=dims)
            said.append("accepted")
        except ConfigError as e:
            said.append(str(e))
    assert said[0].startswith("run.cp=4: Qwen3ForCausalLM has no context-parallel plan")
    assert said[1].startswith("run.cp=4 does not divide the attention heads (2) of Qwen3ForCausalLM")
    assert said[2] == "accepted"
