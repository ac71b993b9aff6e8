import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.trajectory import (
    TrajectoryError,
    from_packed,
    make_trajectory,
    real_extent,
    to_packed,
    trim_padding,
    validate,
)
from tests.conftest import random_batch


def test_random_batch_is_valid():
    validate(random_batch())


def _broken(**changes):
    b = random_batch(B=4, T=8)
    fields = dict(b.items())
    for k, v in changes.items():
        if v is None:
            fields.pop(k)
        else:
            fields[k] = v(fields[k]) if callable(v) else v
    return fields


@pytest.mark.parametrize(
    "changes, field, words",
    [
        (dict(group_id=None), "group_id", "missing"),
        (dict(policy_version=None), "policy_version", "missing"),
        (dict(reward=lambda r: r[:3]), "reward", "shape"),
        (dict(rollout_logprobs=lambda x: x[:, :5]), "rollout_logprobs", "shape"),
        (dict(group_id=lambda x: x.float()), "group_id", "dtype"),
        (dict(tokens=lambda x: x.float()), "tokens", "dtype"),
        (dict(reward=lambda r: torch.tensor([0.0, float("nan"), 1.0, 0.0])), "reward", "NaN"),
        (dict(rollout_logprobs=lambda x: x.clone().index_put_((torch.tensor([1]), torch.tensor([4])),
                                                                torch.tensor(float("-inf")))),
         "rollout_logprobs", "NaN/inf"),
        (dict(rollout_logprobs=lambda x: -x + 0.5), "rollout_logprobs", "positive"),
    ],
)
def test_validation_errors_name_the_field(changes, field, words):
    fields = _broken(**changes)
    with pytest.raises(TrajectoryError) as e:
        make_trajectory(**fields)
    assert str(e.value).startswith(field) and words in str(e.value)


def test_action_mask_on_padding():
    b = random_batch(B=4, T=8)
    act = b["action_mask"].clone()
    act[:, -1] = True
    act[0, -1] = True
    bad = b.copy()
    bad["attention_mask"] = b["attention_mask"].clone()
    bad["attention_mask"][0, -1] = False
    bad["attention_mask"][0] = torch.arange(8) < 6
    bad["action_mask"] = act & bad["attention_mask"]
    bad["action_mask"][0, 7] = True
    with pytest.raises(TrajectoryError, match="action_mask: set on padding in sequence 0"):
        validate(bad)


def test_left_padding_rejected():
    b = random_batch(B=2, T=6)
    bad = b.copy()
    bad["attention_mask"] = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    bad["action_mask"] = torch.zeros(2, 6, dtype=torch.bool)
    with pytest.raises(TrajectoryError, match="attention_mask: sequence 0 is not right-padded"):
        validate(bad)


def test_action_at_position_zero_rejected():
    b = random_batch(B=2, T=6)
    bad = b.copy()
    bad["action_mask"] = b["action_mask"].clone()
    bad["action_mask"][1, 0] = True
    with pytest.raises(TrajectoryError, match="position 0"):
        validate(bad)


def test_mixed_versions_and_empty_batch():
    b = random_batch(B=4)
    b2 = b.copy()
    b2["policy_version"] = torch.tensor([3, 3, 4, 3])
    validate(b2)  # allowed unless one version is required
    with pytest.raises(TrajectoryError, match=r"policy_version: mixed versions \[3, 4\]"):
        validate(b2, single_version=True)
    with pytest.raises(TrajectoryError, match="empty batch"):
        validate(b[:0])


def test_make_trajectory_rejects_float_masks():
    b = random_batch(B=2)
    fields = dict(b.items())
    fields["action_mask"] = fields["action_mask"].float()
    with pytest.raises(TrajectoryError, match="action_mask: expected a 0/1 mask"):
        make_trajectory(**fields)


@given(st.integers(1, 9), st.integers(2, 12), st.integers(0, 10_000))
def test_packed_roundtrip(B, T, seed):
    b = random_batch(B=B, T=T, seed=seed, prompt_len=1, group_size=2)
    p = to_packed(b)
    assert p["token"].batch_size[0] == int(b["attention_mask"].sum())
    assert p["cu_seqlens"][-1] == p["token"].batch_size[0]
    back = from_packed(p)
    assert set(back.keys()) == set(b.keys())
    for k in b.keys():
        assert torch.equal(back[k], b[k]), k
    validate(back)
    # the packed token stream is exactly the valid tokens in order
    assert torch.equal(p["token"]["tokens"], b["tokens"][b["attention_mask"]])


def test_from_packed_pad_to_too_short():
    p = to_packed(random_batch(B=3, T=8, seed=1))
    with pytest.raises(TrajectoryError, match="pad_to"):
        from_packed(p, pad_to=1)


# ----------------------------------------------------------------------------- the asynchronous fields


def _async_batch():
    """Row 0: prompt 2, actions at versions 3, 3, 4 (resumed across a publication); row 1: prompt 1,
    action v2, one observation token, action v4, padding."""
    from hyperrl.trajectory import stack_episodes

    rows = [dict(tokens=[5, 6, 7, 8, 9], action=[0, 0, 1, 1, 1], logprobs=[0, 0, -1.0, -1.0, -1.0], reward=1.0,
                 group_id=0, version=4, token_versions=[-1, -1, 3, 3, 4], sample_uid=10, finish_reason="stop"),
            dict(tokens=[5, 7, 1, 8], action=[0, 1, 0, 1], logprobs=[0, -0.5, 0, -0.5], reward=0.0, group_id=0,
                 version=4, token_versions=[-1, 2, -1, 4], sample_uid=11, finish_reason="length")]
    return stack_episodes(rows, pad_id=0)


def test_async_fields_row_version_is_the_oldest_token():
    b = _async_batch()
    assert b["policy_version"].tolist() == [3, 2]  # not the row's "version": its oldest action token
    assert b["token_version"].tolist() == [[-1, -1, 3, 3, 4], [-1, 2, -1, 4, -1]]
    assert b["finish_reason"].tolist() == [0, 1] and b["sample_uid"].tolist() == [10, 11]
    validate(b, learner_version=4, max_staleness=2)
    with pytest.raises(TrajectoryError, match=r"token_version: token \[1, 1\] was sampled at version 2: 2 versions "
                                              r"stale at learner version 4, over async.max_staleness=1"):
        validate(b, learner_version=4, max_staleness=1)
    with pytest.raises(TrajectoryError, match="newer than the learner's 3"):
        validate(b, learner_version=3, max_staleness=4)


@pytest.mark.parametrize("key, change, words", [
    ("token_version", lambda b: b["token_version"].index_put((torch.tensor([0]), torch.tensor([2])),
                                                             torch.tensor(-1)), r"action token \[0, 2\] has no"),
    ("token_version", lambda b: b["token_version"].index_put((torch.tensor([1]), torch.tensor([2])),
                                                             torch.tensor(4)), "is not an action but carries"),
    ("policy_version", lambda b: torch.tensor([4, 2]), "row 0 says 4 but its oldest action token was sampled at 3"),
    ("sample_uid", lambda b: torch.tensor([7, 7]), r"duplicate id 7 at rows \[0, 1\]"),
    ("finish_reason", lambda b: torch.tensor([0, 5]), "code 5 at row 1"),
])
def test_async_field_violations_name_the_field(key, change, words):
    b = _async_batch()
    b.set(key, change(b))
    with pytest.raises(TrajectoryError, match=f"^{key}: .*{words}"):
        validate(b)


def test_kv_version_is_at_most_the_token_version_on_actions_only():
    """Row 0's third action (v4) was sampled over a cache of v3 (a kept KV cache): valid; a cache newer
    than the token, or a kv_version off the actions, is refused naming the field."""
    b = _async_batch()
    kv = torch.where(b["action_mask"], torch.tensor([[0, 0, 3, 3, 3], [0, 2, 0, 4, 0]]), -1)
    validate(b.copy().set("kv_version", kv))
    with pytest.raises(TrajectoryError, match=r"^kv_version: action token \[1, 1\] has kv_version 3 with "
                                              r"token_version 2"):
        validate(b.copy().set("kv_version", kv.index_put((torch.tensor([1]), torch.tensor([1])), torch.tensor(3))))
    with pytest.raises(TrajectoryError, match=r"^kv_version: token \[0, 0\] is not an action"):
        validate(b.copy().set("kv_version", kv.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(1))))


def test_padding_keeps_the_version_contract():
    from hyperrl.trajectory import NO_VERSION, cat_batches

    b = _async_batch()
    short = make_trajectory(**{k: v[:, :3] if v.dim() == 2 else v for k, v in b[1:].items()})
    short.set("sample_uid", torch.tensor([12]))
    both = cat_batches([b, short], pad_id=0)  # the short batch padded to T = 5 with NO_VERSION
    assert both["token_version"][2, 3:].tolist() == [NO_VERSION, NO_VERSION]
    validate(both)
    validate(from_packed(to_packed(b)))  # padding restored as 0: ignored (only real tokens are checked)


@given(st.integers(1, 10), st.integers(4, 16), st.integers(0, 50))
def test_trim_padding_cuts_token_fields_to_the_widest_row_and_keeps_the_rest(B, T, seed):
    b = random_batch(B=B, T=T, group_size=1, seed=seed, holes=True)
    b = b.set("advantages", torch.randn(B, T) * b["action_mask"]).set("reward_components", torch.ones(B, T))
    t = trim_padding(b)
    w = int(b["attention_mask"].sum(-1).max())  # right-padded rows: the widest row's length
    assert t["tokens"].shape == (B, w) and t["advantages"].shape == (B, w) and t["action_mask"].shape == (B, w)
    assert t["reward_components"].shape == (B, T)  # not a token field ([B, K] here K = T): left alone
    for k in ("tokens", "attention_mask", "action_mask", "rollout_logprobs", "advantages"):
        assert torch.equal(t[k], b[k][:, :w]) and not b[k][:, w:].any()  # only padding was cut
    assert torch.equal(real_extent(t), b["attention_mask"].sum(-1)) and b["tokens"].shape == (B, T)  # input kept
    validate(t)
