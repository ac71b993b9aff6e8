"""hyperrl.forward: the shared-prefix forward equals the plain forward (values and gradients)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.loop.forward import (
    packed_logprobs_and_entropy,
    plain_logprobs_and_entropy,
    policy_logprobs,
    prefix_groups,
    shared_prefix_logprobs_and_entropy,
)
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rollout import SamplingParams, TransformersEngine
from hyperrl.trajectory import make_trajectory, validate

V = 40
MODEL = tiny_qwen3(V, seed=1, dtype=torch.float64)


def _batch(rows):
    """rows: (prompt ids, [(segment ids, is_action), ...]) → a right-padded trajectory."""
    seqs = [(p, [(t, a) for seg, a in segs for t in seg]) for p, segs in rows]
    T = max(len(p) + len(r) for p, r in seqs)
    B = len(seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.bool)
    act = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, r) in enumerate(seqs):
        ids = p + [t for t, _ in r]
        tokens[b, : len(ids)] = torch.tensor(ids)
        attn[b, : len(ids)] = True
        act[b, len(p): len(ids)] = torch.tensor([a for _, a in r], dtype=torch.bool)
    lp = torch.where(act, -1.0, 0.0)
    return make_trajectory(tokens=tokens, attention_mask=attn, action_mask=act, rollout_logprobs=lp,
                           policy_version=torch.zeros(B, dtype=torch.long), group_id=torch.arange(B),
                           reward=torch.zeros(B))


def test_prefix_groups_golden():
    # prompts [1,5] ×2, [1,5,6] (extends the first but is a different prompt), [1,7] — 3 distinct
    b = _batch([([1, 5], [([9, 2], True)]), ([1, 5, 6], [([3], True)]), ([1, 5], [([4], True)]),
                ([1, 7], [([8, 8, 2], True)])])
    p, inv, first = prefix_groups(b)
    assert p.tolist() == [2, 3, 2, 2]
    assert inv[0] == inv[2] and len({int(inv[0]), int(inv[1]), int(inv[3])}) == 3
    assert first[inv].tolist() == [0, 1, 0, 3]  # the first row holding each prompt


segment = st.tuples(st.lists(st.integers(3, V - 1), min_size=1, max_size=4), st.booleans())
row_shape = st.tuples(st.integers(0, 3), st.lists(segment, min_size=1, max_size=3))


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(3, V - 1), min_size=1, max_size=5), min_size=1, max_size=3),
       rows=st.lists(row_shape, min_size=2, max_size=8))
def test_shared_prefix_equals_plain_values_and_grads(prompts, rows):
    """Multi-turn shapes too: responses interleave action and observation segments; the first segment
    is forced to be an action so the prompt ends where the row's first action begins."""
    spec = []
    for k, segs in rows:
        segs = [(segs[0][0], True)] + segs[1:]
        spec.append(([1] + prompts[k % len(prompts)], segs))
    b = _batch(spec)
    validate(b)
    act = b["action_mask"]
    w = torch.randn(act.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(rows)))
    params = list(MODEL.parameters())
    out = [_values_and_grads(*f(MODEL, b, 0.9), w, act, params)
           for f in (plain_logprobs_and_entropy, shared_prefix_logprobs_and_entropy)]
    _assert_same(*out, atol=1e-5, rtol=1e-5, grad_rtol=1e-4)


def _values_and_grads(lp, ent, w, act, params):
    """The action positions' log-probs and entropies, and the parameters' gradients of a weighted sum of both."""
    g = torch.autograd.grad(((lp + 0.1 * ent) * w * act).sum(), params)
    return lp[act].detach(), ent[act].detach(), g


def _assert_same(a, b, *, atol, rtol, grad_rtol):
    (lp0, e0, g0), (lp1, e1, g1) = a, b
    torch.testing.assert_close(lp1, lp0, atol=atol, rtol=rtol)
    torch.testing.assert_close(e1, e0, atol=atol, rtol=rtol)
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, atol=atol, rtol=grad_rtol)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(row_shape, min_size=1, max_size=8), budget=st.integers(0, 30))
def test_packed_equals_plain_values_and_grads(rows, budget):
    """The padding-free forward (rows packed into sequences of ≤ budget tokens, position ids restarting
    per row) gives the plain forward's log-probs, entropies and gradients on every action position,
    and computes no padding token."""
    b = _batch([([1, 5, 6][: 1 + k], [(segs[0][0], True)] + segs[1:]) for k, segs in rows])
    act = b["action_mask"]
    w = torch.randn(act.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(rows)))
    params = list(MODEL.parameters())
    count = _Count(MODEL)
    out = []
    try:
        for f in (plain_logprobs_and_entropy, lambda m, x, t: packed_logprobs_and_entropy(m, x, t, budget)):
            lp, ent = f(MODEL, b, 0.9)
            g = torch.autograd.grad(((lp + 0.1 * ent) * w * act).sum(), params)
            out.append((lp[act].detach(), ent[act].detach(), g, lp[~act], ent[~act]))
    finally:
        count.h.remove()
    (lp0, e0, g0, *_), (lp1, e1, g1, off_lp, off_ent) = out
    torch.testing.assert_close(lp1, lp0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(e1, e0, atol=1e-6, rtol=1e-6)
    for a, c in zip(g1, g0):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)
    assert not off_lp.any() and not off_ent.any()
    packed = count.calls[1:]
    assert sum(n for _, n in packed) == int(b["attention_mask"].sum())  # every real token once, no padding
    assert all(n <= max(budget, int(b["attention_mask"].sum(-1).max())) for _, n in packed) or budget == 0


def test_packed_refuses_rows_that_are_not_right_padded():
    b = _batch([([1, 5], [([7, 8], True)]), ([1], [([9], True)])])
    left = b.copy().set("attention_mask", b["attention_mask"].flip(-1))
    with pytest.raises(ValueError, match="right-padded rows"):
        packed_logprobs_and_entropy(MODEL, left, 1.0)


class _Count:
    """Counts the rows × tokens each forward call of a model runs."""

    def __init__(self, model):
        self.calls = []
        self.h = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.calls.append(tuple(kwargs["input_ids"].shape))


def test_shared_prefix_runs_each_prompt_once_and_falls_back_without_sharing():
    # 2 prompts × 4 samples, one-token answers: one forward over the 2 distinct prompts only
    b = _batch([([1, 5, 6, 7], [([k + 3], True)]) for k in range(4)] + [([1, 8, 9], [([k + 3], True)])
                                                                         for k in range(4)])
    c = _Count(MODEL)
    lp, _ = policy_logprobs(MODEL, b, 1.0)
    assert c.calls == [(2, 4)]
    torch.testing.assert_close(lp[b["action_mask"]], plain_logprobs_and_entropy(MODEL, b, 1.0)[0][b["action_mask"]])
    # every prompt distinct: the plain forward is cheaper and is used
    c.calls.clear()
    policy_logprobs(MODEL, _batch([([1, k + 3], [([4, 5], True)]) for k in range(4)]), 1.0)
    assert c.calls == [(4, 3)]
    c.calls.clear()
    policy_logprobs(MODEL, b, 1.0, shared_prefix=False)
    assert c.calls == [(8, 4)]
    c.h.remove()


def test_engine_prefills_each_prompt_once():
    eng = TransformersEngine(tiny_qwen3(V, seed=2))
    c = _Count(eng.model)
    b = eng.generate([[1, 5, 6], [1, 7]], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0), n=5)
    assert c.calls[0] == (2, 3) and all(s == (10, 1) for s in c.calls[1:])
    assert b["tokens"].shape[0] == 10
    c.h.remove()


def test_position_zero_action_is_rejected():
    b = _batch([([1], [([4], True)]), ([1], [([5], True)])])
    b = b.copy().set("action_mask", b["attention_mask"].clone())
    with pytest.raises(ValueError, match="position 0"):
        shared_prefix_logprobs_and_entropy(MODEL, b, 1.0)


def test_agreed_choice_forces_the_same_model_calls():
    """Data parallel: a rank whose answers are one token long still runs the continuation forward
    when another rank needs it (agree → S = 2), and the result is unchanged."""
    b = _batch([([1, 5, 6], [([k + 3], True)]) for k in range(4)])
    c = _Count(MODEL)
    lp, _ = policy_logprobs(MODEL, b, 1.0, agree=lambda use, S: (use, max(S, 3)))
    assert c.calls == [(1, 3), (4, 1)]  # prompt once, then a continuation call (its outputs all padding)
    torch.testing.assert_close(lp[b["action_mask"]], plain_logprobs_and_entropy(MODEL, b, 1.0)[0][b["action_mask"]])
    c.calls.clear()
    policy_logprobs(MODEL, b, 1.0, agree=lambda use, S: (False, S))  # another rank prefers plain
    assert c.calls == [(4, 3)]
    c.h.remove()


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 14), min_size=4, max_size=12), seed=st.integers(0, 3))
def test_bucketed_continuation_equals_one_call_values_and_grads(lengths, seed):
    """The continuation run in buckets of similar length (each call cut to its rows' longest) gives the one-call
    values and gradients (the float64 model: equal to rounding); the calls are the prompt pass and one per bucket
    with a continuation, each as wide as its longest row needs."""
    from hyperrl import transforms as T
    from hyperrl.loop import shared_prefix

    g = torch.Generator().manual_seed(seed)
    prompts = [[1, 5, 6], [1, 7, 8, 9]]
    b = _batch([(prompts[k % 2], [(torch.randint(3, V, (n,), generator=g).tolist(), True)])
                for k, n in enumerate(lengths)])
    act = b["action_mask"]
    w = torch.randn(act.shape, dtype=torch.float64, generator=g)
    params = list(MODEL.parameters())
    out, calls = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shared_prefix, "BUCKET_CALL_COST", 3)
        mp.setattr(shared_prefix, "BUCKET_MIN_WIDTH", 1)
        for bucket in (False, True):
            c = _Count(MODEL)
            lp, ent = shared_prefix_logprobs_and_entropy(MODEL, b, 0.9, bucket=bucket)
            c.h.remove()
            calls.append(c.calls)
            out.append(_values_and_grads(lp, ent, w, act, params))
    _assert_same(*out, atol=1e-10, rtol=1e-10, grad_rtol=1e-9)
    needs = [n - 1 for n in lengths]
    buckets = [bk for bk in T.length_buckets(needs, 3) if max(needs[i] for i in bk) > 0]
    assert calls[0] == [(2, 4), (len(lengths), max(needs))] if max(needs) > 0 else [(2, 4)]
    if max(needs) > 0:
        assert calls[1] == [(2, 4)] + [(len(bk), max(needs[i] for i in bk)) for bk in buckets]


def test_bucketing_is_off_when_the_forward_is_agreed_or_narrow():
    """Data-parallel ranks (an agreed forward) make one continuation call each, whatever their lengths; a
    continuation narrower than BUCKET_MIN_WIDTH is one call."""
    from hyperrl.loop import shared_prefix

    lengths = [1, 1, 1, 1, 1, 1, 12, 12]  # a split saves 6 · 11 = 66 tokens
    b = _batch([([1, 5, 6], [(list(range(3, 3 + n)), True)]) for n in lengths])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shared_prefix, "BUCKET_CALL_COST", 3)
        c = _Count(MODEL)
        policy_logprobs(MODEL, b, 1.0)
        assert c.calls == [(1, 3), (2, 11)]  # the one-token rows need no continuation input at all
        c.calls.clear()
        policy_logprobs(MODEL, b, 1.0, agree=lambda use, S: (use, S))
        assert c.calls == [(1, 3), (8, 11)]
        c.calls.clear()
        mp.setattr(shared_prefix, "BUCKET_MIN_WIDTH", 12)
        policy_logprobs(MODEL, b, 1.0)
        assert c.calls == [(1, 3), (8, 11)]
        c.h.remove()


def test_plain_forward_computes_logits_only_on_the_action_window():
    from hyperrl.loop.forward import plain_logprobs_and_entropy
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.trajectory import make_trajectory

    model = tiny_qwen3(11, hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, seed=3)
    B, T_ = 3, 9
    tokens = torch.randint(1, 11, (B, T_), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(B, T_, dtype=torch.bool)
    act = torch.arange(T_)[None, :] >= torch.tensor([4, 6, 5])[:, None]  # first action at 4
    b = make_trajectory(tokens=tokens, attention_mask=attn, action_mask=act, rollout_logprobs=torch.zeros(B, T_),
                        policy_version=torch.zeros(B, dtype=torch.long), group_id=torch.arange(B),
                        reward=torch.zeros(B))
    shapes = []
    orig = model.forward
    model.forward = lambda *a, **kw: shapes.append(kw.get("logits_to_keep")) or orig(*a, **kw)
    lp, ent = plain_logprobs_and_entropy(model, b, 1.0)
    assert shapes == [T_ - 4]  # logits for positions 3 … 7 only
    with torch.no_grad():
        full = torch.log_softmax(orig(input_ids=tokens[:, :-1]).logits.float(), -1)
    want = full.gather(-1, tokens[:, 1:, None])[..., 0]
    assert torch.allclose(lp[:, 1:][act[:, 1:]], want[act[:, 1:]], atol=1e-5)
    assert (lp[:, :4] == 0).all() and lp.shape == (B, T_) and ent.shape == (B, T_)


@settings(max_examples=25, deadline=None)
@given(U=st.integers(1, 6), B=st.integers(1, 24), tail=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_the_row_select_gradient_is_autograds_bit_for_bit_from_a_non_contiguous_gradient(U, B, tail, seed):
    # shared_prefix._Rows: index_select whose backward makes the gradient contiguous first — the same index_add_ sums
    from hyperrl.loop.shared_prefix import _rows

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(U, 2, 5, 4, generator=g, requires_grad=True)
    index = torch.randint(0, U, (B,), generator=g)
    wide = torch.randn(B, 2, 5 + tail, 4, generator=g) * 10.0 ** torch.randint(-4, 4, (B, 1, 1, 1), generator=g)
    grad = wide[:, :, :5]  # a slice of a concatenation: non-contiguous when tail > 0
    want, = torch.autograd.grad(x.index_select(0, index), x, grad)
    out = _rows(x, index)
    got, = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, x.index_select(0, index)) and torch.equal(got, want)


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.lists(st.integers(-3, 3), min_size=4, max_size=4), min_size=1, max_size=40))
def test_the_distinct_rows_are_numbered_as_torch_unique_numbers_them(rows):
    from hyperrl.loop.shared_prefix import _unique_rows

    x = torch.tensor(rows, dtype=torch.long)
    assert torch.equal(_unique_rows(x), torch.unique(x, dim=0, return_inverse=True)[1])
