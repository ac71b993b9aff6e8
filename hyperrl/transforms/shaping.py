"""Reward shaping: pure functions of rewards and lengths."""

from __future__ import annotations

import torch

from hyperrl.registry import PositiveInt, Registry

__all__ = ["SHAPING", "register_shaping", "overlong_penalty", "clip_rewards", "kl_in_reward", "mask_truncated"]


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


# ----------------------------------------------------------------------------- registry
# A shaping stage is a batch transform ``(batch, **hyperparams) -> new batch`` over ``reward``.

SHAPING: Registry = Registry("reward shaping")
register_shaping = SHAPING.register


@register_shaping("overlong", needs=("reward",), produces=("reward",))
def _overlong(batch, *, max_len: PositiveInt, buffer: PositiveInt | None = None):
    """DAPO soft overlong punishment added to ``reward``. ``max_len``: the response budget (filled
    from ``rollout.max_new_tokens`` by the config when not given); ``buffer`` None = a fifth of it,
    at least 1 (DAPO: 4,096 of 20,480)."""
    buf = max(1, max_len // 5) if buffer is None else buffer
    pen = overlong_penalty(batch["action_mask"].sum(-1), max_len=max_len, buffer=buf)
    return batch.copy().set("reward", batch["reward"] + pen)


@register_shaping("clip", needs=("reward",), produces=("reward",))
def _clip(batch, *, lo: float = -10.0, hi: float = 10.0):
    """Clamp ``reward`` to ``[lo, hi]`` (OpenRLHF ±10)."""
    return batch.copy().set("reward", clip_rewards(batch["reward"], lo=lo, hi=hi))
