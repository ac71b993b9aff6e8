"""Resumable requests: keyed sampling, abort at a decode step, resume from the exact partial tokens."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rollout import (
    Request,
    SamplingParams,
    TransformersEngine,
    keyed_sample,
    keyed_uniform,
    requests_for,
    resume_requests,
)
from hyperrl.tokenizer import char_tokenizer
from hyperrl.trajectory import validate
from hyperrl.transforms import sequence_logprobs

TOK = char_tokenizer()
SP = SamplingParams(max_new_tokens=12, temperature=1.0, eos_id=TOK.eos_token_id, seed=5)


def _splitmix_reference(seed: int, uid: int, index: int) -> float:
    """splitmix64's finaliser in exact Python integers mod 2^64 (what the int64 tensor code must equal)."""
    M = (1 << 64) - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    h = mix((seed + 0x9E3779B97F4A7C15) & M)
    h = mix(h ^ uid)
    h = mix(h ^ index)
    return (h >> 11) * 2.0 ** -53


@given(st.integers(0, 2**31), st.lists(st.integers(0, 2**40), min_size=1, max_size=6), st.integers(0, 4096))
def test_keyed_uniform_is_exact_splitmix_and_independent_of_the_batch(seed, uids, index):
    u = keyed_uniform(seed, torch.tensor(uids), torch.full((len(uids),), index))
    assert [float(x) for x in u] == [_splitmix_reference(seed, x, index) for x in uids]
    assert bool(((u >= 0) & (u < 1)).all())


def test_keyed_sample_follows_the_distribution_and_never_picks_a_filtered_token():
    p = torch.tensor([0.5, 0.0, 0.3, 0.2])
    logp = torch.log(p).expand(20_000, 4)
    tok = keyed_sample(logp, keyed_uniform(0, torch.arange(20_000), torch.zeros(20_000, dtype=torch.long)))
    freq = torch.bincount(tok, minlength=4).double() / 20_000
    assert freq[1] == 0  # probability 0 (e.g. outside top-k): never sampled
    assert torch.allclose(freq, p.double(), atol=0.015), freq  # 3σ of a binomial at n = 20k is ≈ 0.011


@pytest.fixture(scope="module")
def engine():
    return TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=0))


class _AbortAfter:
    """``is_set()`` turns true after ``k`` decode steps (a publication arriving mid-generation)."""

    def __init__(self, k):
        self.k, self.calls = k, 0

    def is_set(self):
        self.calls += 1
        return self.calls > self.k


def _row(b, uid):
    i = int((b["sample_uid"] == uid).nonzero()[0])
    n = int(b["attention_mask"][i].sum())
    return b["tokens"][i, :n], b["rollout_logprobs"][i, :n], b["token_version"][i, :n]


@pytest.mark.parametrize("k", [0, 1, 4])
def test_an_interruption_without_a_weight_change_changes_no_token(engine, k):
    reqs = requests_for([TOK.encode("12+34="), TOK.encode("7*8=")], 4, uid_offset=100, group_offset=3)
    full = engine.generate_requests(reqs, SP)
    validate(full)
    assert full["sample_uid"].tolist() == list(range(100, 108)) and full["group_id"].tolist() == [3] * 4 + [4] * 4
    part = engine.generate_requests(reqs, SP, abort=_AbortAfter(k))
    aborted = part["finish_reason"] == 2  # rows that sampled EOS within k steps finished ("stop")
    assert int(aborted.sum()) >= 6 and bool((part["action_mask"].sum(-1)[aborted] == k).all())
    cont = engine.generate_requests(resume_requests(part), SP)
    done = {int(u) for u in part["sample_uid"][~aborted]}
    for uid in range(100, 108):
        (t0, lp0, _), (t1, lp1, _) = _row(full, uid), _row(part if uid in done else cont, uid)
        assert torch.equal(t0, t1)  # keyed sampling: the same tokens
        assert (lp0 - lp1).abs().max() < 1e-6  # re-prefill vs cached decode: float rounding only
    assert set(cont["finish_reason"].tolist()) <= {0, 1}


def test_resumed_under_new_weights_tokens_keep_their_versions(engine):
    reqs = requests_for([TOK.encode("5+5=")], 3, uid_offset=0)
    part = engine.generate_requests(reqs, SP, abort=_AbortAfter(3))
    new = tiny_qwen3(TOK.vocab_size, seed=1)  # a publication: version 1
    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=0))
    eng.load_weights(new.state_dict(), version=1)
    cont = eng.generate_requests(resume_requests(part), SP)
    validate(cont)
    act = cont["action_mask"]
    for i in range(3):
        v = cont["token_version"][i][act[i]].tolist()
        assert v[:3] == [0, 0, 0] and set(v[3:]) <= {1} and len(v) > 3  # one row, two versions
    assert cont["policy_version"].tolist() == [0, 0, 0]  # the oldest token's
    # the new tokens' log-probs are the new weights', the partial ones stay the old weights'
    with torch.no_grad():
        lp_new = sequence_logprobs(new(input_ids=cont["tokens"], attention_mask=cont["attention_mask"].long()).logits,
                                   cont["tokens"])
    fresh = act & (cont["token_version"] == 1)
    assert (lp_new - cont["rollout_logprobs"])[fresh].abs().max() < 1e-5
    old = act & (cont["token_version"] == 0)
    assert torch.equal(cont["rollout_logprobs"][old], part["rollout_logprobs"][part["action_mask"]])


def test_request_errors_name_the_problem(engine):
    with pytest.raises(ValueError, match="sampling.seed"):
        engine.generate_requests(requests_for([TOK.encode("1")], 1, uid_offset=0),
                                 SamplingParams(max_new_tokens=4, seed=None))
    full = Request(7, (5, 6), partial=(8,) * 12, partial_logprobs=(-1.0,) * 12, partial_versions=(0,) * 12)
    with pytest.raises(ValueError, match="Request 7: 12 tokens generated already"):
        engine.generate_requests([full], SP)
    with pytest.raises(ValueError, match="differ in length"):
        Request(8, (5,), partial=(1, 2), partial_logprobs=(-1.0,), partial_versions=(0, 0))
    assert math.isfinite(float(engine.generate_requests([Request(9, (5, 6))], SP)["rollout_logprobs"].sum()))


def test_a_multi_turn_row_is_not_resumed(engine):
    from hyperrl.trajectory import stack_episodes

    b = stack_episodes([dict(tokens=[5, 6, 7, 1, 8], action=[0, 1, 0, 0, 1], logprobs=[0, -1.0, 0, 0, -1.0],
                             reward=0.0, group_id=0, version=0, sample_uid=3, finish_reason="aborted")])
    with pytest.raises(ValueError, match="row 0 .sample_uid 3. has non-action tokens after its first action"):
        resume_requests(b)


def test_finished_rows_stop_being_computed_and_each_row_is_what_it_would_be_alone(engine):
    """Rows with budgets of 1–12 tokens: once half the computed rows have finished, the decode step
    runs on the live rows only (the forward's batch shrinks) — and every row's tokens are what it
    generates alone (keyed sampling), log-probs within float rounding."""
    reqs = [Request(50 + i, tuple(TOK.encode(p)), i % 3, tuple([7] * k), tuple([0.0] * k), tuple([0] * k))
            for i, (p, k) in enumerate([("1+2=", 11), ("3+4=", 11), ("5+6=", 10), ("7+8=", 0), ("9+1=", 11),
                                        ("2+2=", 9), ("8*9=", 11), ("4*4=", 2)])]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)  # no stop token: each row runs its budget
    sizes = []
    hook = engine.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    try:
        batch = engine.generate_requests(reqs, sp)
    finally:
        hook.remove()
    assert sizes[0] == 8 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)  # 8 rows → the long one
    assert batch["action_mask"].sum(-1).tolist() == [12] * 8
    for r in reqs:
        (t0, lp0, _), (t1, lp1, _) = _row(batch, r.uid), _row(engine.generate_requests([r], sp), r.uid)
        assert torch.equal(t0, t1) and (lp0 - lp1).abs().max() < 1e-5
