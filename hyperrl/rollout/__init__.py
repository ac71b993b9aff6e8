"""Rollout engines producing token-first trajectory batches (one protocol; see :mod:`.base`)."""

from .base import RolloutEngine, SamplingParams, TransactionalEngine, WeightPublishError, WeightTransaction
from .engines import ENGINES, EngineContext, register_engine
from .hf import TransformersEngine, filter_logits, tiny_qwen3
from .requests import Request, keyed_sample, keyed_uniform, requests_for, resume_requests
from .workers import EXECUTORS, LocalWorker, WorkerDied, WorkerError, Workers, register_executor

__all__ = ["ENGINES", "EngineContext", "register_engine", "RolloutEngine", "SamplingParams", "WeightPublishError",
           "WeightTransaction", "TransactionalEngine", "TransformersEngine", "filter_logits", "tiny_qwen3",
           "Request", "keyed_uniform", "keyed_sample", "requests_for", "resume_requests", "EXECUTORS",
           "register_executor", "Workers", "LocalWorker", "WorkerError", "WorkerDied"]
