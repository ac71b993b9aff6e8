"""hyperrl — functional, JAX-style RL for language models over PyTorch.

The public API, one import away (``import hyperrl as hr``):

* the batch contract — :func:`make_trajectory`, :func:`validate`, :func:`to_packed` /
  :func:`from_packed`, :class:`TrajectoryError` (:mod:`hyperrl.trajectory`);
* the pure transforms — ``hr.transforms`` (advantages, objectives, KL, aggregation, shaping,
  correction, filters, …) and the plug-in contract :class:`Registry`;
* the resharding planner — ``hr.sharding`` (meshes, specs, layouts, :func:`~hyperrl.sharding.reshard_plan`);
* the loop — ``hr.load_config(path, overrides)``, ``hr.build(cfg)`` (the composition root: a ready
  trainer), ``hr.train(cfg)`` (the outer loop of ``hyperrl train``), ``hr.Trainer`` (one class
  for every kind of run; ``hr.SyncTrainer`` and ``hr.AsyncTrainer`` are its earlier names),
  ``hr.TrainConfig``, ``hr.ConfigError``.

The transforms and the planner import no training package (transformers, tokenizers, …); the loop
names load on first use. Modules whose names start with ``_`` are private.
"""

import importlib

from hyperrl import transforms
from hyperrl.registry import Registry
from hyperrl.trajectory import TrajectoryError, from_packed, make_trajectory, to_packed, validate

__version__ = "0.1.0"

# loop-level names, imported on first access so that `import hyperrl.transforms` stays light
_LAZY = {"sharding": "hyperrl.sharding", "load_config": "hyperrl.config", "TrainConfig": "hyperrl.config",
         "ConfigError": "hyperrl.config", "build": "hyperrl.compose", "train": "hyperrl.run",
         "Trainer": "hyperrl.loop.trainer", "SyncTrainer": "hyperrl.loop.trainer",
         "AsyncTrainer": "hyperrl.loop.trainer"}

__all__ = ["transforms", "Registry", "TrajectoryError", "make_trajectory", "validate", "to_packed", "from_packed",
           *_LAZY]


def __getattr__(name: str):
    """The loop-level public names of ``__all__``, loaded on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'hyperrl' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return module if name == "sharding" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
