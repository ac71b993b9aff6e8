"""The loop layer: the trainer and what it calls.

* :mod:`.trainer` — :class:`Trainer` (state, step, save / resume; one class for every kind of run —
  ``SyncTrainer``, ``AsyncTrainer`` and ``PreferenceTrainer`` are its earlier names);
* :mod:`.collect` — the :class:`Collector` protocol, its :class:`Collected` record and the synchronous collector;
  :mod:`.collect_async` — the asynchronous one (a coordinator), :mod:`.async_queue` — its units, rows and waiting
  requests, :mod:`hyperrl.rollout.workers.schedules` — its schedules, :mod:`.admission` — its pure buffer;
  :mod:`.drivers` — one driver per kind of rollout (plain, episodes, agent), used by both collectors;
* :mod:`.generation`, :mod:`.scoring` — generation rounds and rewards;
* :mod:`.pipeline` — the algorithm's bound components; :mod:`.prepare` — the trainer's forwards and
  the key providers' runner (values, baselines, old / reference log-probs, the gate:
  :mod:`hyperrl.algorithms`); :mod:`.forward` — the forward kernels; :mod:`.learner` — the optimizer
  steps; :mod:`.evaluate` — held-out evaluation;
* :mod:`.publish` — policy → engine; :mod:`.checkpoint`, :mod:`.checkpointer` — the format and
  the per-rank writer; :mod:`.hooks` — metrics files, progress, TensorBoard, W&B, the reward plot.

The names below load on first use, so the pure admission buffer (:mod:`.admission`) imports
without the training packages.
"""

import importlib

_LAZY = {"Trainer": "hyperrl.loop.trainer", "SyncTrainer": "hyperrl.loop.trainer",
         "AsyncTrainer": "hyperrl.loop.trainer", "GateError": "hyperrl.loop.trainer",
         "PreferenceTrainer": "hyperrl.loop.trainer", "Collected": "hyperrl.loop.collect",
         "Collector": "hyperrl.loop.collect", "SyncCollector": "hyperrl.loop.collect",
         "AsyncCollector": "hyperrl.loop.collect_async", "Pipeline": "hyperrl.loop.pipeline",
         "build_pipeline": "hyperrl.loop.pipeline"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    """The names of ``__all__``, imported from their modules on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'hyperrl.loop' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
