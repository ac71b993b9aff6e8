"""Reward shaping: pure functions of rewards and lengths."""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty", "clip_rewards", "kl_in_reward", "mask_truncated"]


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025), ``[B] → [B]`` fp32:
    ``0`` if ``|y| ≤ L_max − L_buf``; ``(L_max − L_buf − |y|)/L_buf`` inside the buffer; ``−1`` beyond ``L_max``.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer={buffer}: must satisfy 0 < buffer ≤ max_len={max_len}")
    y = lengths.float()
    inside = (max_len - buffer - y) / buffer
    return torch.where(y <= max_len - buffer, torch.zeros_like(y), torch.where(y <= max_len, inside, -1.0))


def clip_rewards(rewards: torch.Tensor, *, lo: float = -10.0, hi: float = 10.0) -> torch.Tensor:
    """Clamp rewards to ``[lo, hi]`` (OpenRLHF: ±10)."""
    return torch.clamp(rewards, lo, hi)


def kl_in_reward(token_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, beta: float) -> torch.Tensor:
    """KL in the reward: ``r_t − β·kl_t`` on action tokens ``[B, T]`` (kl detached)."""
    return torch.where(mask.bool(), token_rewards - beta * kl.detach(), token_rewards)


def mask_truncated(action_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Drop truncated completions (no EOS within the budget) from the loss: ``m & ~truncated[:, None]``."""
    return action_mask.bool() & ~truncated.bool()[:, None]
