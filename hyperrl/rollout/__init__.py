"""Rollout engines producing token-first trajectory batches (one protocol; see :mod:`.base`)."""

from .base import RolloutEngine, SamplingParams, TransactionalEngine, WeightPublishError, WeightTransaction
from .engines import ENGINES, EngineContext, register_engine
from .hf import TransformersEngine, filter_logits, tiny_qwen3

__all__ = ["ENGINES", "EngineContext", "register_engine", "RolloutEngine", "SamplingParams", "WeightPublishError",
           "WeightTransaction", "TransactionalEngine", "TransformersEngine", "filter_logits", "tiny_qwen3"]
