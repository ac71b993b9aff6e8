import pytest
import torch

from hyperrl.transforms import entropy, naive_token_logprobs, sequence_logprobs, token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_naive_value_and_grad(dtype, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    w = torch.randn(3, 7, generator=g)
    x = logits.clone().requires_grad_(True)
    lp = token_logprobs(x, tokens, temperature, chunk_size=4)
    assert lp.dtype == torch.float32
    (gx,) = torch.autograd.grad((lp * w).sum(), x)
    y = logits.clone().requires_grad_(True)
    ref = naive_token_logprobs(y, tokens, temperature)
    (gy,) = torch.autograd.grad((ref * w).sum(), y)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gx.float(), gy.float(), atol=tol, rtol=tol)
    assert gx.dtype == dtype


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_entropy_matches_autograd(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 33, generator=g) * 2
    w = torch.randn(2, 5, generator=g)
    x = logits.clone().requires_grad_(True)
    h = entropy(x, temperature, chunk_size=3)
    (gx,) = torch.autograd.grad((h * w).sum(), x)
    y = logits.clone().requires_grad_(True)
    p = torch.log_softmax(y / temperature, -1)
    ref = -(p.exp() * p).sum(-1)
    (gy,) = torch.autograd.grad((ref * w).sum(), y)
    torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gy, atol=1e-5, rtol=1e-5)
    # uniform logits: H = log V
    assert float(entropy(torch.zeros(1, 33))) == pytest.approx(float(torch.log(torch.tensor(33.0))), abs=1e-5)


def test_sequence_logprobs_alignment():
    # logits[:, t] predicts token t+1: out[:, t] = log p(tokens[t] | <t), out[:, 0] = 0
    logits = torch.randn(2, 4, 10)
    tokens = torch.randint(0, 10, (2, 4))
    out = sequence_logprobs(logits, tokens)
    assert (out[:, 0] == 0).all()
    want = torch.log_softmax(logits[:, 2], -1).gather(-1, tokens[:, 3:4])[:, 0]
    torch.testing.assert_close(out[:, 3], want)


def test_inputs_not_mutated():
    from hyperrl.transforms import logprobs_and_entropy

    logits = torch.randn(2, 3, 7)
    before = logits.clone()
    x = logits.requires_grad_(True)
    lp, h = logprobs_and_entropy(x, torch.zeros(2, 3, dtype=torch.long), 0.5)
    (lp.sum() + h.sum()).backward()
    assert torch.equal(logits.detach(), before)


def test_errors():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match=r"logits \[2, 5\]"):
        token_logprobs(torch.randn(2, 5), torch.zeros(3, dtype=torch.long))


def test_backward_saves_no_fp32_vocab_copy():
    """The autograd graph keeps only the low-precision logits: saved tensors are the inputs."""
    logits = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 64, (4, 8))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, tokens).sum()
        entropy(logits).sum()
    assert all(not (dt == torch.float32 and n >= logits.numel()) for dt, n in saved), saved


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fused_logprobs_and_entropy_value_and_grad(temperature):
    from hyperrl.transforms import logprobs_and_entropy

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 40, generator=g) * 2
    tokens = torch.randint(0, 40, (2, 6), generator=g)
    w1, w2 = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    x = logits.clone().requires_grad_(True)
    lp, h = logprobs_and_entropy(x, tokens, temperature, chunk_size=5)
    (gx,) = torch.autograd.grad((lp * w1).sum() + (h * w2).sum(), x)
    y = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(y / temperature, -1)
    ref_lp = logp.gather(-1, tokens[..., None])[..., 0]
    ref_h = -(logp.exp() * logp).sum(-1)
    (gy,) = torch.autograd.grad((ref_lp * w1).sum() + (ref_h * w2).sum(), y)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gx, gy, atol=1e-5, rtol=1e-5)
    # only one output used: the other's gradient is None
    x2 = logits.clone().requires_grad_(True)
    (g_only,) = torch.autograd.grad(logprobs_and_entropy(x2, tokens, temperature)[1].sum(), x2)
    y2 = logits.clone().requires_grad_(True)
    logp2 = torch.log_softmax(y2 / temperature, -1)
    (g_ref,) = torch.autograd.grad(-(logp2.exp() * logp2).sum(), y2)
    torch.testing.assert_close(g_only, g_ref, atol=1e-5, rtol=1e-5)
