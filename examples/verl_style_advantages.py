"""Calling hyperrl's advantage estimator on verl-shaped inputs.

verl hands its estimators ``token_level_rewards [B, T]`` (the outcome reward on the last response
token), ``response_mask [B, T]`` and ``index`` — a numpy object array of uid strings (one uuid4
per prompt). hyperrl's kernels take integer group ids; one ``np.unique`` maps the uids.
``singleton="raw"`` and ``eps=1e-6`` reproduce verl's ``grpo`` exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from hyperrl.transforms import grpo_advantages


def verl_grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
              epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for verl's ``compute_grpo_outcome_advantage``: returns (advantages, returns) ``[B, T]``."""
    scores = token_level_rewards.sum(-1)
    _, group_ids = np.unique(index, return_inverse=True)
    adv = grpo_advantages(scores, torch.from_numpy(group_ids.reshape(-1)), eps=epsilon, singleton="raw")
    adv = adv[:, None] * response_mask
    return adv, adv


if __name__ == "__main__":
    import uuid

    B, T = 8, 5
    uids = [str(uuid.uuid4()) for _ in range(2)]
    index = np.array([uids[i // 4] for i in range(B)], dtype=object)
    mask = torch.ones(B, T)
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])
    adv, _ = verl_grpo(rewards, mask, index)
    print(adv[:, 0])
