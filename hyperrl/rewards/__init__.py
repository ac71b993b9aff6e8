"""Rewards: one registry (``REWARDS``: reward functions and reward factories), the built-in
functions (:mod:`.builtin`), and rewards as users write them — TRL-, verl- and hyperrl-style
functions from a file or the registry, weighted, routed by ``data_source`` (:mod:`.styles`; how each style calls
its functions: :mod:`.calling`), and a batch scored with them (:mod:`.scoring`).
"""

from hyperrl.rewards import (
    code,  # noqa: E402,F401 — registers the `code` reward (the sandbox's unit tests)
    judge,  # noqa: E402,F401 — registers the `judge` reward (a judge model)
    remote,  # noqa: E402,F401 — registers the `remote` reward (a reward server)
)
from hyperrl.rewards.builtin import (
    REWARDS,
    RewardName,
    digit_credit,
    digit_match,
    exact_answer,
    extract_gsm8k_answer,
    first_char_exact,
    gsm8k_exact,
    is_factory,
    normalize_number,
    register_reward,
    register_reward_factory,
    starts_with_digit,
)
from hyperrl.rewards.scoring import RewardSet
from hyperrl.rewards.styles import Reward, RewardError, build_rewards, check_rewards, load_function

__all__ = ["REWARDS", "register_reward", "register_reward_factory", "is_factory", "RewardName", "Reward", "RewardSet",
           "RewardError", "load_function", "build_rewards", "check_rewards", "extract_gsm8k_answer",
           "normalize_number", "gsm8k_exact", "first_char_exact", "exact_answer", "digit_credit", "digit_match",
           "starts_with_digit"]
