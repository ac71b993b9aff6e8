import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.trajectory import TrajectoryError, from_packed, make_trajectory, to_packed, validate

from .conftest import random_batch


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
