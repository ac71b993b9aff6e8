"""hyperrl.transforms — pure RL-for-LLM transforms over PyTorch tensors and TensorDict batches.

Each concept lives in its own module (``advantages``, ``objectives``, ``aggregation``, ``kl``,
``logprobs``, ``correction``, ``shaping``, ``filters``, ``preference``, ``batching``, ``stats``,
``loss``, ``chain``; mixture-of-experts router terms ``moe``; for asynchronous RL ``staleness``;
learning-rate ``schedules``); this facade re-exports the public names. Kernels take tensors and
the scalars they use; adapters take a trajectory TensorDict and return a new one (or a LossOutput).
"""

from hyperrl.transforms.advantages import (
    ADVANTAGES,
    batch_std_advantages,
    compute_advantages,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    gpg_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    grpo_process_advantages,
    masked_whiten,
    normalize_then_sum_advantages,
    opo_advantages,
    register_advantage,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
)
from hyperrl.transforms.aggregation import AGGREGATIONS, Normalizer, aggregate, register_aggregation
from hyperrl.transforms.batching import (
    balanced_partition,
    length_buckets,
    micro_batches_by_padded_budget,
    micro_batches_by_token_budget,
    padded_cost,
    partition_spread,
)
from hyperrl.transforms.chain import bind, chain
from hyperrl.transforms.correction import (
    CORRECTIONS,
    Correction,
    importance_weights,
    m2po_global_mask,
    m2po_mask,
    m2po_threshold,
    masked_is,
    mismatch_log_ratio,
    mismatch_metrics,
    register_correction,
    rejection_mask,
    truncated_is,
)
from hyperrl.transforms.distill import (
    add_distill_advantages,
    distill_advantages,
    full_vocab_jsd,
    full_vocab_reverse_kl,
    scale_advantages,
)
from hyperrl.transforms.filters import FILTERS, dynamic_sampling_filter, informative_groups, register_filter
from hyperrl.transforms.groups import GroupStats, dense_group_index, group_stats
from hyperrl.transforms.head import head_divergence, head_logprobs_and_entropy
from hyperrl.transforms.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KLController,
    KLState,
    adaptive_kl_init,
    adaptive_kl_update,
    fixed_kl_init,
    fixed_kl_update,
    is_corrected_kl,
    kl_penalty,
    register_kl,
    register_kl_controller,
)
from hyperrl.transforms.logprobs import (
    entropy,
    logprobs_and_entropy,
    naive_token_logprobs,
    sequence_logprobs,
    token_logprobs,
)
from hyperrl.transforms.loss import LossOutput, critic_loss, policy_loss
from hyperrl.transforms.moe import load_balancing_loss, router_loss, router_metrics
from hyperrl.transforms.objectives import (
    OBJECTIVES,
    Objective,
    cispo,
    clip_cov,
    dppo_kl,
    dppo_tv,
    dro,
    gmpo,
    gspo,
    kl_cov,
    ppo_clip,
    register_objective,
    reinforce,
    sapo,
    topr,
    value_loss,
)
from hyperrl.transforms.preference import PREFERENCE_LOSSES, DPOLoss, dpo_loss, preference_loss
from hyperrl.transforms.schedules import LR_SCHEDULES, lr_multiplier
from hyperrl.transforms.shaping import (
    SHAPING,
    clip_rewards,
    kl_in_reward,
    mask_truncated,
    overlong_penalty,
    register_shaping,
)
from hyperrl.transforms.staleness import (
    interpolated_proximal_logprobs,
    proximal_alpha,
    row_policy_version,
    staleness_mask,
    staleness_metrics,
    token_staleness,
)
from hyperrl.transforms.stats import RunningStats, running_stats_init, running_stats_normalize, running_stats_update

__all__ = [
    # registries
    "ADVANTAGES", "OBJECTIVES", "AGGREGATIONS", "KL_ESTIMATORS", "KL_CONTROLLERS", "CORRECTIONS", "SHAPING", "FILTERS",
    "register_advantage", "register_objective", "register_aggregation", "register_kl", "register_kl_controller",
    "register_correction", "register_shaping", "register_filter", "KLController",
    # adapters and composition
    "compute_advantages", "policy_loss", "critic_loss", "LossOutput", "chain", "bind",
    # advantages
    "grpo_advantages", "dr_grpo_advantages", "batch_std_advantages", "rloo_advantages", "opo_advantages",
    "gpg_advantages", "grpo_passk_advantages", "normalize_then_sum_advantages", "gae", "reinforce_pp_returns",
    "reinforce_pp_baseline_advantages", "remax_advantages", "grpo_process_advantages", "discounted_returns",
    "masked_whiten",
    "scores_to_token_rewards", "group_stats", "GroupStats", "dense_group_index",
    # distillation
    "distill_advantages", "add_distill_advantages", "scale_advantages", "full_vocab_reverse_kl", "full_vocab_jsd",
    # objectives
    "Objective", "ppo_clip", "gspo", "cispo", "sapo", "gmpo", "reinforce", "dppo_tv", "dppo_kl", "dro", "topr",
    "clip_cov", "kl_cov", "value_loss",
    # aggregation
    "Normalizer", "aggregate",
    # kl
    "kl_penalty", "is_corrected_kl", "KLState", "fixed_kl_init", "fixed_kl_update", "adaptive_kl_init",
    "adaptive_kl_update",
    # logprobs
    "token_logprobs", "entropy", "logprobs_and_entropy", "sequence_logprobs", "naive_token_logprobs",
    "head_logprobs_and_entropy", "head_divergence",
    # correction
    "Correction", "mismatch_log_ratio", "importance_weights", "truncated_is", "masked_is", "rejection_mask",
    "mismatch_metrics", "m2po_mask", "m2po_threshold", "m2po_global_mask",
    # mixture of experts
    "load_balancing_loss", "router_metrics", "router_loss",
    # shaping, filters, preference, batching, stats
    "overlong_penalty", "clip_rewards", "kl_in_reward", "mask_truncated",
    "informative_groups", "dynamic_sampling_filter",
    "dpo_loss", "DPOLoss", "PREFERENCE_LOSSES", "preference_loss",
    "micro_batches_by_token_budget", "micro_batches_by_padded_budget", "padded_cost", "balanced_partition",
    "partition_spread", "length_buckets",
    "RunningStats", "running_stats_init", "running_stats_update", "running_stats_normalize",
    # asynchronous RL: staleness and the proximal policy
    "token_staleness", "staleness_mask", "staleness_metrics", "row_policy_version", "proximal_alpha",
    "interpolated_proximal_logprobs",
    # learning-rate schedules
    "LR_SCHEDULES", "lr_multiplier",
]
