"""hyperrl.sharding — a pure, hardware-free sharding-spec algebra and direct-reshard planner.

Meshes and specs are plain frozen data (:mod:`.mesh`, :mod:`.spec`); model layouts say where
each tensor lives (:mod:`.layout` — generic; :mod:`.models` — model numbers and the trainer's
side; :mod:`.vllm` — vLLM's fused, padded parameters); :func:`reshard_plan` computes exactly the
intersections each source rank sends each destination rank; :func:`verify` proves a plan
covers every destination element once; :mod:`.report` describes a plan (bytes, busiest rank,
traffic) and :mod:`.timing` predicts its time on given links; executors (:mod:`.execute`) run
plans on ``torch.distributed`` and :mod:`.publisher` runs them into an engine's transaction.
"""

from hyperrl.sharding.layout import (
    Block,
    ChunkRule,
    Demand,
    DstLayout,
    DstParam,
    Layout,
    LayoutError,
    Part,
    Placement,
    check_compatible,
    plain_destination,
)
from hyperrl.sharding.mesh import Mesh, MeshError
from hyperrl.sharding.plan import Plan, reshard_plan
from hyperrl.sharding.report import PlanStats
from hyperrl.sharding.spec import Box, Spec, SpecError, boxes, chunk_bounds, dim_intervals, owners
from hyperrl.sharding.timing import Links, TimePrediction, predict
from hyperrl.sharding.transfer import Transfer
from hyperrl.sharding.verify import PlanError, verify
from hyperrl.sharding.vllm import HeadReplicaRule, rollout_layout

__all__ = [
    "Mesh", "MeshError", "Spec", "SpecError", "Box", "boxes", "owners", "chunk_bounds", "dim_intervals",
    "Placement", "Layout", "DstLayout", "DstParam", "Part", "Block", "ChunkRule", "HeadReplicaRule", "Demand",
    "LayoutError", "check_compatible", "plain_destination", "rollout_layout",
    "reshard_plan", "Plan", "PlanStats", "Transfer", "verify", "PlanError", "Links", "TimePrediction", "predict",
]
