"""hyperrl.transforms.head_logprobs_and_entropy: the LM head fused with the log-prob and entropy equals the unfused
path — values and the gradients of the hidden states, the weight and the bias — and keeps no [N, V] tensor."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl import transforms as T


def _unfused(h, w, b, tok, temp, masks=()):
    z = torch.nn.functional.linear(h, w, b)
    for ids, v in masks:
        z = z.index_fill(-1, torch.tensor(ids), v)
    return T.logprobs_and_entropy(z, tok, temp)


def _run(fn, h, w, b, tok, g_lp, g_ent):
    leaves = [x for x in (h, w, b) if x is not None]
    lp, ent = fn()
    grads = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), leaves)
    return lp.detach(), ent.detach(), grads


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), Tn=st.integers(1, 6), H=st.integers(1, 12), V=st.integers(2, 40),
       temp=st.sampled_from([0.3, 0.7, 1.0, 1.6]), chunk=st.one_of(st.none(), st.integers(1, 7)),
       bias=st.booleans(), mask=st.booleans(), seed=st.integers(0, 1000))
def test_fused_equals_unfused_values_and_grads(B, Tn, H, V, temp, chunk, bias, mask, seed):
    """float64: any chunking, temperature, bias and output mask — equal to the unfused path to rounding."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, Tn, H, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    masks = (([0, V - 1], -1e4),) if mask and V > 2 else ()
    tok = torch.randint(masks and 1 or 0, V - 1 if masks else V, (B, Tn), generator=g)
    g_lp, g_ent = torch.randn(B, Tn, dtype=torch.float64, generator=g), torch.randn(B, Tn, dtype=torch.float64,
                                                                                    generator=g)
    fused = _run(lambda: T.head_logprobs_and_entropy(h, w, tok, temp, bias=b, chunk_size=chunk, masks=masks),
                 h, w, b, tok, g_lp, g_ent)
    ref = _run(lambda: _unfused(h, w, b, tok, temp, masks), h, w, b, tok, g_lp, g_ent)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-6)  # lp/ent are fp32 in both
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-6, atol=1e-6)
    for a, c in zip(fused[2], ref[2]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("amp", [False, True])
def test_one_chunk_is_the_unfused_path_bit_for_bit(amp):
    """fp32 and bf16 autocast (the trainer's mixed precision): with one chunk every value and gradient is the
    unfused path's exactly — the small-vocabulary default keeps its bits whichever path runs."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    tok = torch.randint(0, 50, (3, 5), generator=g)
    g_lp, g_ent = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        a = _run(lambda: T.head_logprobs_and_entropy(h, w, tok, 0.8), h, w, None, tok, g_lp, g_ent)
        b = _run(lambda: _unfused(h, w, None, tok, 0.8), h, w, None, tok, g_lp, g_ent)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_bf16_entropy_is_computed_in_fp32_whatever_the_autocast():
    """Under bf16 autocast both paths' entropy is the fp64 entropy of the bf16 logits to fp32 rounding (the
    unfused path used to run its Σ p·z in bf16: 0.02 nats off)."""
    g = torch.Generator().manual_seed(1)
    h, w, tok = torch.randn(2, 5, 16, generator=g), torch.randn(50, 16, generator=g), torch.randint(0, 50, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = torch.nn.functional.linear(h, w)
        _, e_unfused = T.logprobs_and_entropy(z, tok)
        _, e_fused = T.head_logprobs_and_entropy(h, w, tok)
    z = z.double()
    ref = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    assert float((e_fused.double() - ref).abs().max()) < 1e-4
    assert float((e_unfused.double() - ref).abs().max()) < 1e-4


def test_an_fp32_head_on_a_bf16_forward():
    """``compute_dtype=float32`` (model.lm_head_fp32) under bf16 autocast: the fp32 head's numbers — the head's
    matmul in fp32 — chunked or not."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 3, 8, generator=g).bfloat16().float().requires_grad_()
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    tok = torch.randint(0, 30, (4, 3), generator=g)
    g_lp, g_ent = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)

    def ref():
        with torch.autocast("cpu", enabled=False):
            return _unfused(h.float(), w.float(), None, tok, 1.3)

    b = _run(ref, h, w, None, tok, g_lp, g_ent)
    for chunk in (None, 5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = _run(lambda c=chunk: T.head_logprobs_and_entropy(h, w, tok, 1.3, compute_dtype=torch.float32,
                                                                 chunk_size=c), h, w, None, tok, g_lp, g_ent)
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)
        for x, y in zip(a[2], b[2]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_no_logits_sized_tensor_is_kept_for_backward():
    """What autograd keeps between the passes: the hidden states, the weight, the tokens and two floats a row —
    nothing of N × V (the unfused path keeps the logits)."""
    N, H, V = 64, 8, 512
    h, w = torch.randn(1, N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    tok = torch.randint(0, V, (1, N))
    for fused, bound in ((True, max(N * H, V * H)), (False, None)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t.numel()) or t,
                                                      lambda t: t):
            lp, ent = (T.head_logprobs_and_entropy(h, w, tok, chunk_size=16) if fused
                       else _unfused(h, w, None, tok, 1.0))
        (lp.sum() + ent.sum()).backward()
        if fused:
            assert max(saved) <= bound, saved
        else:
            assert max(saved) >= N * V  # the logits: what the fused path does without


def test_bad_shapes_are_named():
    h, w = torch.randn(2, 3, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"hidden \[2, 3, 8\] must be tokens \[2, 4\] \+ \[H\]"):
        T.head_logprobs_and_entropy(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight \[10, 7\] must be \[V, H=8\]"):
        T.head_logprobs_and_entropy(h, torch.randn(10, 7), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"bias \[9\] must be \[V=10\]"):
        T.head_logprobs_and_entropy(h, w, torch.zeros(2, 3, dtype=torch.long), bias=torch.randn(9))
    with pytest.raises(ValueError, match="temperature=0.0"):
        T.head_logprobs_and_entropy(h, w, torch.zeros(2, 3, dtype=torch.long), 0.0)


@settings(max_examples=25, deadline=None)
@given(N=st.integers(1, 8), H=st.integers(1, 8), Ht=st.integers(1, 8), V=st.integers(3, 30),
       beta=st.sampled_from([0.0, 0.3, 1.0]), temp=st.sampled_from([0.5, 1.0, 1.7]),
       chunk=st.one_of(st.none(), st.integers(1, 5)), mask=st.booleans(), seed=st.integers(0, 1000))
def test_head_divergence_equals_the_whole_distributions(N, H, Ht, V, beta, temp, chunk, mask, seed):
    """Full-vocabulary distillation's JSD_β from the two heads chunk by chunk = the same divergence of the two whole
    log-softmaxes; the gradient reaches the student's hidden states and head only."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, N, H, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    th = torch.randn(1, N, Ht, dtype=torch.float64, generator=g, requires_grad=True)
    tw = torch.randn(V, Ht, dtype=torch.float64, generator=g)
    masks = (([V - 1], -1e4),) if mask else ()
    gg = torch.randn(1, N, dtype=torch.float64, generator=g)

    def div(s, t):
        return T.full_vocab_jsd(s, t, beta)

    got = T.head_divergence(h, w, th, tw, div, temp, chunk_size=chunk, masks=masks, teacher_masks=masks)
    zs, zt = torch.nn.functional.linear(h, w), torch.nn.functional.linear(th, tw)
    for ids, v in masks:
        zs, zt = zs.index_fill(-1, torch.tensor(ids), v), zt.index_fill(-1, torch.tensor(ids), v)
    want = div(torch.log_softmax(zs.float() / temp, -1), torch.log_softmax(zt.float() / temp, -1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    a = torch.autograd.grad((got * gg).sum(), [h, w])
    b = torch.autograd.grad((want * gg).sum(), [h, w])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert th.grad is None


def test_head_divergence_refuses_two_vocabularies():
    with pytest.raises(ValueError, match="teacher vocabulary 12 differs from the student's 10"):
        T.head_divergence(torch.randn(2, 4), torch.randn(10, 4), torch.randn(2, 3), torch.randn(12, 3),
                          lambda s, t: (s - t).sum(-1))
