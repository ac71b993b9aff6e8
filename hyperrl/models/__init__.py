"""Every model the loop trains or serves from: the tiny Qwen3 built from a config, the policy from a
local checkpoint, the frozen reference, the critic (:class:`ValueModel`), LoRA (PEFT) views, and a
mixture-of-experts policy's routers (:class:`RouterTap`; routing replay and capture: :class:`Routing`).
Rollout engines build no training model; this package builds them all."""

from hyperrl.models.critic import ValueModel
from hyperrl.models.lora import AdapterDisabled, MergedView, TrainableView, apply_lora, is_lora, trainable_parameters
from hyperrl.models.moe import RouterTap, Routing, check_routes, is_moe, moe_routers, replay_weights
from hyperrl.models.policy import build_critic, build_policy, build_reference, build_tokenizer
from hyperrl.models.tiny import tiny_qwen2_5_vl, tiny_qwen3, tiny_qwen3_moe

__all__ = ["tiny_qwen3", "tiny_qwen3_moe", "tiny_qwen2_5_vl", "is_moe", "moe_routers", "RouterTap", "Routing",
           "check_routes", "replay_weights", "ValueModel", "build_tokenizer",
           "build_policy", "build_reference", "build_critic",
           "apply_lora", "AdapterDisabled", "MergedView", "TrainableView", "is_lora", "trainable_parameters"]
