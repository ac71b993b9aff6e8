"""The MoE router terms (hyperrl.transforms.moe): the load-balancing loss equals the model family's own
(transformers' Qwen3-MoE ``load_balancing_loss_func``), ignores padding, and its metrics stay in their ranges."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hyperrl import transforms as T


def test_golden_two_experts_top1():
    # 2 tokens, E = 2, k = 1: p = softmax([1, 0]) = [.731, .269] and its mirror; each expert takes one token:
    # f = [.5, .5], P = [.5, .5] → aux = 2 · (.5·.5 + .5·.5) = 1.0 (= k: balanced)
    aux = T.load_balancing_loss([torch.tensor([[1.0, 0.0], [0.0, 1.0]])], 1)
    assert aux.item() == pytest.approx(1.0)
    # both tokens on expert 0: f = [1, 0], P = [.731, .269] → aux = 2 · .731 = 1.462
    aux = T.load_balancing_loss([torch.tensor([[1.0, 0.0], [1.0, 0.0]])], 1)
    assert aux.item() == pytest.approx(2 * math.exp(1) / (1 + math.exp(1)), rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 3), B=st.integers(1, 3), Tn=st.integers(1, 5), E=st.integers(2, 8), data=st.data())
def test_equals_the_families_formula_with_and_without_padding(L, B, Tn, E, data):
    k = data.draw(st.integers(1, E))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    logits = [torch.randn(B * Tn, E, generator=g) for _ in range(L)]
    assert T.load_balancing_loss(logits, k).item() == pytest.approx(
        float(load_balancing_loss_func(tuple(logits), E, k)), rel=1e-5, abs=1e-6)
    am = torch.rand(B, Tn, generator=g) < 0.7
    am[0, 0] = True
    ours = T.load_balancing_loss(logits, k, am.reshape(-1))
    assert ours.item() == pytest.approx(float(load_balancing_loss_func(tuple(logits), E, k, am.long())),
                                        rel=1e-5, abs=1e-6)
    # what the padding holds changes nothing
    noisy = [torch.where(am.reshape(-1, 1), x, 100 * torch.randn(x.shape, generator=g)) for x in logits]
    assert T.load_balancing_loss(noisy, k, am.reshape(-1)).item() == pytest.approx(ours.item(), rel=1e-6)
    m = T.router_metrics(logits, k, am.reshape(-1))
    assert 1 - 1e-5 <= m["moe_load_max"] <= E / k + 1e-5
    assert -1e-6 <= m["moe_router_entropy"] <= math.log(E) + 1e-5
    assert all(f"moe_load_max_l{i}" in m for i in range(L))


def test_router_loss_is_a_term_with_a_gradient_and_refuses_bad_input():
    x = torch.randn(6, 4, requires_grad=True)
    out = T.router_loss([x], 2, 0.01)
    out.loss.backward()
    assert set(out.terms) == {"loss_router_aux"} and x.grad.abs().sum() > 0
    assert out["loss_router_aux"].item() == pytest.approx(0.01 * out["moe_aux_loss"].item())
    assert T.router_loss([x.detach()], 2, 0.0).terms == {}  # coefficient 0: metrics only
    with pytest.raises(ValueError, match="top_k=5"):
        T.load_balancing_loss([x], 5)
    with pytest.raises(ValueError, match=r"mask: shape \(5,\), expected \[6\]"):
        T.load_balancing_loss([x], 2, torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="same shape"):
        T.load_balancing_loss([x, torch.randn(5, 4)], 2)
    with pytest.raises(ValueError, match="no MoE layer"):
        T.load_balancing_loss([], 2)
