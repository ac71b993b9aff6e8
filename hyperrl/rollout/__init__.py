"""Rollout engines producing token-first trajectory batches (one protocol; see :mod:`.base`)."""

from hyperrl.rollout.base import (
    RolloutEngine,
    SamplingParams,
    TransactionalEngine,
    WeightPublishError,
    WeightTransaction,
)
from hyperrl.rollout.engines import ENGINES, EngineContext, register_engine
from hyperrl.rollout.hf import TransformersEngine, filter_logits
from hyperrl.rollout.requests import Request, keyed_sample, keyed_uniform, requests_for, resume_requests
from hyperrl.rollout.workers import EXECUTORS, register_executor
from hyperrl.rollout.workers.base import LocalWorker, WorkerDied, WorkerError, Workers

__all__ = ["ENGINES", "EngineContext", "register_engine", "RolloutEngine", "SamplingParams", "WeightPublishError",
           "WeightTransaction", "TransactionalEngine", "TransformersEngine", "filter_logits",
           "Request", "keyed_uniform", "keyed_sample", "requests_for", "resume_requests", "EXECUTORS",
           "register_executor", "Workers", "LocalWorker", "WorkerError", "WorkerDied"]
