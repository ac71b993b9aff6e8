"""The kernels compose with torch.func (grad, vmap) and compile with fullgraph=True."""

import pytest
import torch
from torch.func import grad, vmap

from hyperrl.transforms import (
    aggregate,
    cispo,
    dr_grpo_advantages,
    gspo,
    kl_penalty,
    ppo_clip,
    rloo_advantages,
    sapo,
    token_logprobs,
)
from hyperrl.transforms.advantages import grpo_advantages


def _data(seed=0, B=6, T=8):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g)
    old = lp - 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    return lp, old, adv, mask


def test_func_grad_matches_autograd():
    lp, old, adv, mask = _data()

    def f(x):
        return aggregate(ppo_clip(x, old, adv, mask, clip_high=0.28).loss, mask, "token-mean")

    g1 = grad(f)(lp)
    x = lp.clone().requires_grad_(True)
    (g2,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g1, g2)


def test_func_grad_through_chunked_logprobs():
    logits = torch.randn(2, 3, 11)
    tokens = torch.randint(0, 11, (2, 3))
    g1 = grad(lambda z: token_logprobs(z, tokens, chunk_size=2).sum())(logits)
    g2 = grad(lambda z: torch.log_softmax(z, -1).gather(-1, tokens[..., None]).sum())(logits)
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)


def test_vmap_over_independent_runs():
    E = 3
    lps, olds, advs, masks = zip(*[_data(s) for s in range(E)])
    lp, old, adv, mask = map(torch.stack, (lps, olds, advs, masks))
    for obj in (ppo_clip, sapo, cispo, gspo):
        f = lambda a, b, c, d: aggregate(obj(a, b, c, d).loss, d, "token-mean")  # noqa: B023
        batched = vmap(f)(lp, old, adv, mask)
        loop = torch.stack([f(lp[e], old[e], adv[e], mask[e]) for e in range(E)])
        torch.testing.assert_close(batched, loop)
    kl = vmap(lambda a, b: kl_penalty(a, b, "k3"))(lp, old)
    torch.testing.assert_close(kl, kl_penalty(lp, old, "k3"))
    # per-example gradients: vmap(grad)
    per_ex = vmap(grad(lambda a, b, c, d: aggregate(ppo_clip(a, b, c, d).loss, d, "token-mean")))(lp, old, adv, mask)
    assert per_ex.shape == lp.shape


@pytest.mark.slow
def test_compile_fullgraph_representative_set():
    torch._dynamo.reset()
    s = torch.randint(0, 2, (64,)).float()
    g = torch.randint(0, 8, (64,)) * 13 - 40
    for fn in (grpo_advantages, rloo_advantages, dr_grpo_advantages):
        compiled = torch.compile(fn, fullgraph=True)
        torch.testing.assert_close(compiled(s, g), fn(s, g))
    lp, old, adv, mask = _data(3, B=16, T=32)

    def loss_fn(x, o, a, m):
        return aggregate(ppo_clip(x, o, a, m, clip_high=0.28, dual_clip=3.0).loss, m, "seq-mean-token-mean")

    compiled = torch.compile(loss_fn, fullgraph=True)
    x1 = lp.clone().requires_grad_(True)
    x2 = lp.clone().requires_grad_(True)
    l1, l2 = compiled(x1, old, adv, mask), loss_fn(x2, old, adv, mask)
    torch.testing.assert_close(l1, l2)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(x1.grad, x2.grad)
