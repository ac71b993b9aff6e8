import importlib.util
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from verl_style_advantages import verl_grpo  # noqa: E402


def _inputs(seed=0, B=24, T=6):
    g = torch.Generator().manual_seed(seed)
    uids = [str(uuid.UUID(int=i + 1)) for i in range(7)]
    sizes = [4, 4, 4, 4, 4, 3, 1]  # includes a singleton group
    index = np.array([u for u, n in zip(uids, sizes) for _ in range(n)], dtype=object)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.randint(0, 2, (B,), generator=g).float()
    return rewards, mask, index


def _verl_reference(rewards, mask, index, eps=1e-6):
    """verl's documented grpo semantics, per sample: singleton -> mean 0, std 1."""
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for i in range(len(scores)):
        grp = scores[torch.tensor([u == index[i] for u in index])]
        if len(grp) == 1:
            mu, sd = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mu, sd = grp.mean(), grp.std()
        out[i] = (scores[i] - mu) / (sd + eps)
    return out[:, None] * mask


def test_verl_style_call_matches_reference():
    rewards, mask, index = _inputs()
    adv, ret = verl_grpo(rewards, mask, index)
    ref = _verl_reference(rewards, mask, index)
    # constant groups: hyperrl gives exactly 0 where the reference gives (0 - 0)/(0 + eps) = 0 as well
    torch.testing.assert_close(adv, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(adv, ret)


@pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                    reason="verl not installed on this machine (bench extra + pip install --no-deps verl==0.9.1)")
def test_verl_style_call_matches_verl():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards, mask, index = _inputs(1)
    ours, _ = verl_grpo(rewards, mask, index)
    theirs, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
