"""Rollout engines producing token-first trajectory batches (one protocol; see :mod:`.base`)."""

from .base import RolloutEngine, SamplingParams, WeightPublishError, stage_weights
from .engines import ENGINES, EngineContext, register_engine
from .hf import TransformersEngine, filter_logits, tiny_qwen3

__all__ = ["ENGINES", "EngineContext", "register_engine", "RolloutEngine", "SamplingParams", "WeightPublishError",
           "stage_weights", "TransformersEngine", "filter_logits", "tiny_qwen3"]
