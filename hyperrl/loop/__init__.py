"""The loop layer: the trainer and what it calls.

* :mod:`.trainer` — :class:`Trainer` (state, step, save / resume), :class:`SyncTrainer`,
  :class:`AsyncTrainer`;
* :mod:`.collect` — the :class:`Collector` protocol and the synchronous collector;
  :mod:`.collect_async` — the asynchronous one; :mod:`.admission` — its pure buffer;
* :mod:`.generation`, :mod:`.scoring` — generation rounds and rewards;
* :mod:`.pipeline` — the algorithm's bound components; :mod:`.forward`, :mod:`.learner` — the
  trainer's forwards and the optimizer steps; :mod:`.evaluate` — held-out evaluation;
* :mod:`.publish` — policy → engine; :mod:`.checkpoint`, :mod:`.checkpointer` — the format and
  the per-rank writer; :mod:`.hooks` — metrics files, progress, TensorBoard, W&B, the reward plot.
"""

from hyperrl.loop.collect import Collector, SyncCollector
from hyperrl.loop.collect_async import AsyncCollector
from hyperrl.loop.pipeline import Pipeline, build_pipeline
from hyperrl.loop.trainer import AsyncTrainer, GateError, SyncTrainer, Trainer

__all__ = ["Trainer", "SyncTrainer", "AsyncTrainer", "GateError", "Collector", "SyncCollector", "AsyncCollector",
           "Pipeline", "build_pipeline"]
