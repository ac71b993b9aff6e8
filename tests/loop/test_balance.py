"""Balanced and packed batches across data-parallel ranks (issue 54, item 4), on real gloo process groups:
``optim.balance_rows`` redistributes the step's groups so each rank does about the same work — every row on exactly
one rank, the synced gradient the unbalanced run's; ``optim.pack_tokens`` under FSDP makes the same number of model
calls on every rank."""

import pytest
import torch

from tests.dist_helpers import record_grads, run_gloo

pytestmark = pytest.mark.slow

# rank 0 draws the long responses, rank 1 the short ones: 6 rows (3 groups of 2) each, a long-tailed mix
LENGTHS = {0: [120, 96, 80, 64, 8, 4], 1: [6, 5, 4, 3, 2, 2]}


def _batch(rank: int):
    """Right-padded rows of an 8-token prompt and ``LENGTHS[rank]`` response tokens, advantages set (what the update
    reads); ``sample_uid`` names each row across ranks."""
    import hyperrl.transforms as T
    from hyperrl.trajectory import make_trajectory

    g = torch.Generator().manual_seed(rank)
    lens = LENGTHS[rank]
    Tn, B = 8 + max(lens), len(lens)
    pos = torch.arange(Tn)[None, :]
    real = pos < 8 + torch.tensor(lens)[:, None]
    act = real & (pos >= 8)
    tokens = torch.where(real, torch.randint(3, 20, (B, Tn), generator=g), 0)
    b = make_trajectory(tokens=tokens, attention_mask=real, action_mask=act,
                        rollout_logprobs=torch.where(act, -3.0, 0.0), group_id=torch.arange(B) // 2 + 10 * rank,
                        policy_version=torch.zeros(B, dtype=torch.long), reward=torch.rand(B, generator=g))
    return T.compute_advantages(b, "grpo").set("sample_uid", torch.arange(B) + 100 * rank)


def _worker(rank, world, out_dir, balance):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    tr = build_trainer(load_config(None, [f"--run.out_dir={out_dir}", "--run.eval_every=0", "--run.threads=1",
                                          "--rollout.prompts_per_step=2", "--rollout.n=3",
                                          f"--optim.balance_rows={balance}", "--optim.micro_batch_tokens=256"]))
    seen = record_grads(tr)
    rows = tr.parallel.balance_rows(_batch(rank), 0, tr.policy)[0] if balance else None
    batch, _ = tr.prepare(_batch(rank))
    m = tr.update(batch)
    return {"grads": {k: v.numpy() for k, v in seen.items()}, "m": {k: v for k, v in m.items() if "balance" in k},
            "uids": rows["sample_uid"].tolist() if rows is not None else None,
            "gids": rows["group_id"].tolist() if rows is not None else None,
            "tokens": int(rows["attention_mask"].sum()) if rows is not None else None,
            "rows": {int(u): rows["tokens"][i][rows["attention_mask"][i]].tolist()
                     for i, u in enumerate(rows["sample_uid"])} if rows is not None else None}


def test_balanced_rows_train_the_same_gradient(tmp_path):
    on = run_gloo(_worker, 2, str(tmp_path / "on"), True, timeout=300)
    off = run_gloo(_worker, 2, str(tmp_path / "off"), False, timeout=300)
    # every row on exactly one rank, unchanged
    assert sorted(on[0]["uids"] + on[1]["uids"]) == sorted([*range(6), *range(100, 106)])
    every = {}
    for r in (0, 1):
        b = _batch(r)
        every.update({int(u): b["tokens"][i][b["attention_mask"][i]].tolist() for i, u in enumerate(b["sample_uid"])})
    assert {**on[0]["rows"], **on[1]["rows"]} == every
    # tokens per rank: 420 vs 70 before (1.71× the mean); Karmarkar–Karp over the groups (232, 160, 28 | 27, 23, 20
    # tokens) evens them — a group stays whole, renumbered over the step
    for r in (0, 1):
        gid = on[r]["gids"]
        assert len(set(gid)) * 2 == len(gid)  # whole pairs, distinct ids
    total = sum(8 + n for r in (0, 1) for n in LENGTHS[r])
    m = on[0]["m"]
    assert m["balance_tokens_before"] == pytest.approx(420 / (total / 2))
    assert m["balance_tokens_after"] <= 1.1 and on[0]["m"] == on[1]["m"]
    assert m["balance_work_after"] < m["balance_work_before"]  # the work (attention's L² counted) evens out too
    assert max(on[0]["tokens"], on[1]["tokens"]) / (total / 2) == pytest.approx(m["balance_tokens_after"])
    assert "balance_tokens_before" not in off[0]["m"]
    # the gradient is the unbalanced run's (the global token normaliser), on both ranks
    g_on, g_off = on[0]["grads"], off[0]["grads"]
    assert set(g_on) == set(g_off) and len(g_on) > 10
    gap = max(float(abs(g_on[k] - g_off[k]).max()) / float(abs(g_off[k]).max()) for k in g_off)
    assert gap < 1e-5, gap
    assert all((on[1]["grads"][k] == g_on[k]).all() for k in g_on)


def test_one_process_has_nothing_to_balance():
    from hyperrl.distributed.strategy import LocalParallel

    b = _batch(0)
    out, metrics = LocalParallel().balance_rows(b)
    assert out is b and metrics == {}


def _packed_worker(rank, world, out_dir, pack):
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    tr = build_trainer(load_config(None, [f"--run.out_dir={out_dir}", "--run.eval_every=0", "--run.threads=1",
                                          "--rollout.prompts_per_step=2", "--rollout.n=3", "--optim.balance_rows=false",
                                          f"--optim.pack_tokens={pack}", "--optim.micro_batch_tokens=0"]))
    seen = record_grads(tr)
    calls = []
    tr.policy.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    batch, _ = tr.prepare(_batch(rank))
    tr.update(batch)
    return {"grads": {k: v.numpy() for k, v in seen.items()}, "calls": len(calls)}


def test_packing_under_torchrun_keeps_the_ranks_in_step(tmp_path):
    """optim.pack_tokens on 2 FSDP ranks: rank 0's long rows pack into several sequences, rank 1's short ones into
    one — each rank makes the most calls any rank makes (the extra ones on one token, times 0), and the synced
    gradient is the padded forward's."""
    packed = run_gloo(_packed_worker, 2, str(tmp_path / "packed"), 136, timeout=300)
    padded = run_gloo(_packed_worker, 2, str(tmp_path / "padded"), 0, timeout=300)
    assert packed[0]["calls"] == packed[1]["calls"] > padded[0]["calls"]  # agreed: rank 1 alone would make fewer
    g, ref = packed[0]["grads"], padded[0]["grads"]
    gap = max(float(abs(g[k] - ref[k]).max()) / float(abs(ref[k]).max()) for k in ref)
    assert gap < 1e-5, gap
