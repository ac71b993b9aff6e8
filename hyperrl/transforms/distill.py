"""On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines' "on-policy distillation", 2025;
verl, slime, NeMo-RL's MOPD, prime-rl, ROLL, SkyRL, TRL, AReaL): the student samples, a teacher scores the
student's own tokens, and the per-token advantage is the negative sampled reverse KL

    A_t = −β · (log π_student(y_t | y_<t) − log π_teacher(y_t | y_<t))

— positive where the teacher likes the student's token more than the student does. Estimated on the
sampled token only (one sample of ``KL(π_s ‖ π_t)``), with the *behaviour* log-probs of the student (the
policy that sampled: ``old_logprobs``), detached: a policy-gradient objective then moves the student toward
the teacher on the states it visits. Added to a task advantage with weight ``w`` when both are wanted.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

__all__ = ["distill_advantages", "add_distill_advantages", "scale_advantages", "full_vocab_reverse_kl",
           "full_vocab_jsd"]


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       coef: float = 1.0, clip: float | None = None, whiten: bool = False) -> torch.Tensor:
    """``−coef·(student − teacher)`` on ``mask``, 0 elsewhere; ``[B, T]`` fp32, detached. ``clip``: the
    log-ratio clamped to ``[−clip, clip]`` first; ``whiten``: the result centred and scaled over the batch's
    masked tokens (a baseline: from a random student nearly every sampled token is far below the teacher, the
    raw advantages share a large negative offset, and the policy gradient is mostly noise)."""
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != mask.shape:
        raise ValueError(f"distill_advantages: shapes {tuple(student_logprobs.shape)} (student), "
                         f"{tuple(teacher_logprobs.shape)} (teacher_logprobs), {tuple(mask.shape)} (mask) differ")
    if coef <= 0:
        raise ValueError(f"algo.distill.coef={coef}: must be > 0")
    d = (student_logprobs.detach().float() - teacher_logprobs.detach().float())
    if clip is not None:
        d = d.clamp(-clip, clip)
    a = -coef * d
    m = mask.bool()
    if whiten and bool(m.any()):
        v = a[m]
        a = (a - v.mean()) / (v.std(unbiased=False) + 1e-8)
    return torch.where(m, a, 0.0)


def add_distill_advantages(batch: TensorDict, *, coef: float = 1.0, task_coef: float = 0.0,
                           clip: float | None = None, whiten: bool = False) -> TensorDict:
    """A new batch whose ``advantages`` are ``task_coef·advantages + distill_advantages(old_logprobs,
    teacher_logprobs, action_mask, coef)`` (the task's advantages are dropped at ``task_coef = 0``; the
    distillation term is logged as ``distill_advantages``)."""
    for key in ("old_logprobs", "teacher_logprobs", "action_mask"):
        if key not in batch.keys():
            raise KeyError(f"add_distill_advantages: the batch has no {key!r}")
    m = batch["action_mask"]
    d = distill_advantages(batch["old_logprobs"], batch["teacher_logprobs"], m, coef=coef, clip=clip, whiten=whiten)
    adv = d if task_coef == 0 or "advantages" not in batch.keys() else task_coef * batch["advantages"] + d
    return batch.copy().set("advantages", torch.where(m.bool(), adv, 0.0)).set("distill_advantages", d)


def scale_advantages(batch: TensorDict, *, coef: float = 1.0) -> TensorDict:
    """A new batch whose ``advantages`` are ``coef ·`` the batch's (the task term of full-vocabulary distillation,
    whose distillation signal is a loss term, not an advantage)."""
    return batch.copy().set("advantages", coef * batch["advantages"])


def _pair(student_logp: torch.Tensor, teacher_logp: torch.Tensor, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two log-distributions in fp32, the teacher's detached (one vocabulary is required)."""
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(f"{who}: student {tuple(student_logp.shape)} and teacher {tuple(teacher_logp.shape)} "
                         "distributions differ in shape (one vocabulary is required)")
    return student_logp.float(), teacher_logp.detach().float()


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q) = Σ_v p(v)·(log p(v) − log q(v))`` over the last dim."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def full_vocab_reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """``KL(π_s ‖ π_t) = Σ_v π_s(v)·(log π_s(v) − log π_t(v))`` per position ``[..., V] → [...]`` in fp32: the
    reverse KL over the whole next-token distribution (on-policy GKD, Agarwal et al. 2024, with the student's
    own samples as the states); its gradient flows through the student's log-probabilities only."""
    return _kl(*_pair(student_logp, teacher_logp, "full_vocab_reverse_kl"))


def full_vocab_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2024) as TRL's ``GKDTrainer`` defines its
    ``beta``, per position ``[..., V] → [...]`` in fp32: with the mixture ``M = β·π_t + (1 − β)·π_s``,
    ``JSD_β = β·KL(π_t ‖ M) + (1 − β)·KL(π_s ‖ M)``; the ends are the plain divergences — ``β = 0`` the forward
    ``KL(π_t ‖ π_s)`` (the teacher's distribution as a soft label: supervised on the student's own states),
    ``β = 1`` the reverse ``KL(π_s ‖ π_t)`` (:func:`full_vocab_reverse_kl`) — TRL's special cases: the mixture's JSD
    itself tends to 0 at either end (``M`` → one of the two), so the ends are not its limits. Gradient through the
    student only."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"full_vocab_jsd: beta={beta} must be in [0, 1] (0 forward KL, 1 reverse KL)")
    s, t = _pair(student_logp, teacher_logp, "full_vocab_jsd")
    if beta == 1.0:
        return _kl(s, t)
    if beta == 0.0:
        return _kl(t, s)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(t, m) + (1.0 - beta) * _kl(s, m)
