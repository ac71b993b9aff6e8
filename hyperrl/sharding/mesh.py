"""Abstract device meshes: named axes, sizes, and an explicit physical rank order (no devices)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from hyperrl.errors import HyperRLError

__all__ = ["Mesh", "MeshError"]


class MeshError(HyperRLError, ValueError):
    """An invalid mesh or a mesh/spec mismatch; the message names the axis or rank."""


@dataclass(frozen=True)
class Mesh:
    """``axes``: ordered ``(name, size)`` pairs (row-major, last axis fastest); ``ranks``: the
    physical rank at each mesh position, ``len = Π sizes``. Trainer and rollout meshes may use
    disjoint or overlapping (colocated) rank sets.

    >>> Mesh.of(fsdp=2, tp=2, offset=4).ranks
    (4, 5, 6, 7)
    """

    axes: tuple[tuple[str, int], ...]
    ranks: tuple[int, ...]

    def __post_init__(self):
        names = [a for a, _ in self.axes]
        if len(set(names)) != len(names):
            raise MeshError(f"mesh axes {names}: an axis name is used twice")
        for name, size in self.axes:
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r}: size {size!r} must be a positive int")
        if len(self.ranks) != self.size:
            raise MeshError(f"mesh {dict(self.axes)}: {len(self.ranks)} ranks given, {self.size} needed")
        if len(set(self.ranks)) != len(self.ranks):
            raise MeshError("mesh ranks: a physical rank appears twice")

    @staticmethod
    def of(*, offset: int = 0, ranks=None, **sizes: int) -> Mesh:
        """``Mesh.of(fsdp=4, tp=2)``: axes in keyword order, ranks ``offset, offset+1, …``."""
        axes = tuple(sizes.items())
        n = 1
        for _, s in axes:
            n *= s
        return Mesh(axes, tuple(ranks) if ranks is not None else tuple(range(offset, offset + n)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a for a, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def axis_size(self, name: str) -> int:
        for a, s in self.axes:
            if a == name:
                return s
        raise MeshError(f"unknown mesh axis {name!r}; mesh axes are {list(self.names)}")

    def coords(self):
        """Iterate ``(position, coords dict)`` in row-major order."""
        for pos, c in enumerate(product(*(range(s) for s in self.shape))):
            yield pos, dict(zip(self.names, c))

    def submesh(self, **fixed: int) -> Mesh:
        """The mesh of the remaining axes with ``fixed`` axes pinned (e.g. one EP group)."""
        for k, v in fixed.items():
            if not 0 <= v < self.axis_size(k):
                raise MeshError(f"submesh: {k}={v} out of range [0, {self.axis_size(k)})")
        keep = [(a, s) for a, s in self.axes if a not in fixed]
        ranks = [self.ranks[p] for p, c in self.coords() if all(c[k] == v for k, v in fixed.items())]
        return Mesh(tuple(keep), tuple(ranks))

    def __str__(self) -> str:
        axes = "×".join(f"{a}{s}" for a, s in self.axes) or "single"
        return f"Mesh({axes}, ranks {self.ranks[0]}..{self.ranks[-1]})"
