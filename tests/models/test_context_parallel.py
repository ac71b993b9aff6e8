"""Context parallelism by head exchange (Ulysses; issue 30, item 5 — the layer): on 2 and 4 real gloo
processes, each holding a contiguous slice of every sequence, a tiny Qwen3 (grouped-query attention: 4 query,
2 key/value heads) gives the same token log-probs and entropies as the whole sequence in one process, and —
the loss summed over the slices — the same gradient for every parameter."""

import pytest
import torch

from tests.dist_helpers import run_gloo

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
