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


def _cp_worker(rank, world):
    import torch.distributed as dist

    from hyperrl.distributed.context_parallel import context_parallel, gather_sequence, split_sequence

    model = context_parallel(_model(), dist.group.WORLD)
    tokens, attn, weights = _data()
    local, pos, Tp = split_sequence(tokens, dist.group.WORLD)
    n = Tp // world
    targets = torch.nn.functional.pad(tokens, (0, Tp + 1 - T))[:, rank * n + 1:(rank + 1) * n + 1]
    logits = model(input_ids=local, position_ids=pos).logits  # [B, T'/cp, V]
    lp, ent = _lp_ent(logits, targets)
    lp_full, ent_full = gather_sequence(lp, dist.group.WORLD, T), gather_sequence(ent, dist.group.WORLD, T)
    # the loss over this rank's slice; the slices' gradients sum to the whole sequence's
    mask = (torch.arange(Tp)[None] < attn.sum(-1, keepdim=True) - 1)[:, rank * n:(rank + 1) * n]
    w = torch.nn.functional.pad(weights, (0, Tp - T))[:, rank * n:(rank + 1) * n]
    (lp * w * mask).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[name] = g.numpy()
    return {"lp": lp_full.detach().numpy(), "ent": ent_full.detach().numpy(), "grads": grads}


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_equals_the_whole_sequence_in_one_process(cp):
    res = run_gloo(_cp_worker, cp, timeout=300)
    model = _model()
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
    print(f"cp={cp}: max gaps {gaps}")
    assert gaps["lp"] < 1e-5 and gaps["ent"] < 1e-5 and gaps["grad"] < 1e-5


def _heads_worker(rank, world):
    import torch.distributed as dist

    from hyperrl.distributed.context_parallel import context_parallel, split_sequence
    from hyperrl.models import tiny_qwen3

    model = context_parallel(tiny_qwen3(V, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, seed=1),
                             dist.group.WORLD)
    local, pos, _ = split_sequence(_data()[0], dist.group.WORLD)
    try:
        model(input_ids=local, position_ids=pos)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_cp_that_does_not_divide_the_heads_is_refused():
    assert run_gloo(_heads_worker, 4, timeout=120)[0] == "run.cp=4: must divide the attention heads (2) — Ulysses " \
                                                         "splits heads over ranks"


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


@pytest.mark.parametrize("cp, extra", [(4, []), (2, []), (2, ["--optim.pack_tokens=4096", "--model.lora={r: 4}"]),
                                       (4, ["--algo.kl.coef=0.01", "--optim.micro_batch_tokens=256"]),
                                       (2, ["--optim.fused_head=on", "TEACHER", "--algo.distill.coef=1.0"]),
                                       (4, ["--model.gradient_checkpointing=true"])],
                         ids=["cp4", "cp2xdp2", "cp2xdp2-packed-lora", "cp4-reference-micro",
                              "cp2xdp2-fused-head-teacher", "cp4-checkpointing"])
def test_the_cp_trainers_gradient_is_the_one_process_full_batch_gradient(tmp_path, cp, extra):
    """4 processes, each cp group a slice of every sequence of its rows (cp = 4: one group, all 64 rows; cp = 2:
    two groups of 32): the synced gradient equals one process's over the same 64 rows (keyed sampling), on every
    rank — plain, packed with LoRA adapters, with a reference model's KL and micro-batches, with the fused LM head
    (whose one-process gradient equals the unfused one's: tests/loop/test_fused_head.py) and a distillation teacher
    (its log-probs sliced as the policy's: the advantages, hence the gradient, depend on them), and with gradient
    checkpointing (the Ulysses exchanges replayed in recompute)."""
    if "TEACHER" in extra:
        from tests.loop.test_distill import _teacher

        extra = [f"--algo.distill.teacher={_teacher(tmp_path / 'teacher', seed=7, sharp=2.0)}",
                 *[e for e in extra if e != "TEACHER"]]
    res = run_gloo(_grad_worker, 4, str(tmp_path / "cp"), ["--run.cp=" + str(cp), *extra], timeout=600)
    tr = _trainer(str(tmp_path / "one"), extra)
    one = record_grads(tr)
    m = tr.step()
    assert [res[r]["rows"] for r in range(4)] == ([list(range(8))] * 4 if cp == 4 else
                                                  [[0, 2, 4, 6]] * 2 + [[1, 3, 5, 7]] * 2)
    assert abs(res[0]["reward"] - m["reward_mean"]) < 1e-6 and abs(res[0]["loss"] - m["loss_policy"]) < 1e-5
    assert set(res[0]["grads"]) == set(one) and len(one) > 10
    # (LoRA's A matrices get no gradient at the first step — B starts at 0 — : an absolute gap there)
    gap = max(float((torch.from_numpy(res[0]["grads"][k]) - v).abs().max()) / (float(v.abs().max()) or 1.0)
              for k, v in one.items())
    print(f"cp={cp} {extra}: max relative gradient gap {gap:.2e}")
    assert gap < 1e-5
    assert all((res[r]["grads"][k] == res[0]["grads"][k]).all() for r in res for k in one)  # every rank alike


@pytest.mark.parametrize("over, msg", [
    (["--run.cp=3"], r"run.cp=3 does not divide the world size 4"),
    (["--run.cp=4", "--model.heads=2", "--model.kv_heads=1"], r"run.cp=4 does not divide model.heads=2"),
    (["--run.cp=2", "--run.tp=2", "--rollout.engine={name: transformers, tp: 2}"],
     r"run.cp=2 with run.tp=2: context parallelism is not composed"),
    (["--run.cp=2", "--model.experts=8"], r"run.cp=2: context parallelism trains a dense policy without a mixture"),
    (["--run.cp=2", "--algo.advantage=gae"], r"run.cp=2: context parallelism trains a dense policy without a critic"),
])
def test_bad_cp_settings_are_refused_at_load(over, msg, monkeypatch):
    from hyperrl.config import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "4")  # the world torchrun would give
    with pytest.raises(ConfigError, match=msg):
        load_config(None, over)


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
