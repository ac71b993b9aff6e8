"""hyperrl — functional, JAX-style RL for language models over PyTorch.

Public API: :mod:`hyperrl.trajectory` (the batch contract) and :mod:`hyperrl.transforms`
(pure algorithm transforms). Modules whose names start with ``_`` are private.
"""

from hyperrl import transforms
from hyperrl.registry import Registry
from hyperrl.trajectory import TrajectoryError, from_packed, make_trajectory, to_packed, validate

__version__ = "0.1.0"

__all__ = ["transforms", "Registry", "TrajectoryError", "make_trajectory", "validate", "to_packed", "from_packed"]
