"""One transfer of a reshard plan: which slice of which tensor a rank sends which rank (the plan's
unit; a leaf module, so the planner and the bucketing both import it)."""

from __future__ import annotations

from typing import NamedTuple

from hyperrl.sharding.spec import Box

__all__ = ["Transfer"]


class Transfer(NamedTuple):
    """One transfer of a plan: ``src_rank`` sends ``nbytes`` — ``src_slice`` of ``tensor`` — to ``dst_rank``,
    which writes them at ``dst_slice`` of its local ``param``; ``phase`` 0 from the source, ≥ 1 a forward."""

    src_rank: int
    dst_rank: int
    tensor: str  # source tensor name
    src_slice: Box  # phase 0: in the sender's local shard of `tensor`; phase 1: in its local `param`
    param: str  # destination parameter
    dst_slice: Box  # in the receiver's local `param`
    nbytes: int
    phase: int  # 0: from the source; k ≥ 1: forwarded by a destination replica at depth k of a fan-out tree
    local: bool  # sender and receiver are the same physical rank: a local copy

    def __str__(self) -> str:
        kind = "local" if self.local else ("fwd" if self.phase else "send")
        return (f"{kind:5} {self.src_rank:>5} -> {self.dst_rank:<5} {self.tensor}{self.src_slice} -> "
                f"{self.param}{self.dst_slice} ({self.nbytes} B)")
