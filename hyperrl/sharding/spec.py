"""Sharding specs: for each tensor dim, an *ordered* tuple of mesh axes (outer → inner).

``Spec((("tp", "fsdp"), ()))`` shards dim 0 first over ``tp``, then each tp chunk over ``fsdp``
(FSDP2 applied on top of TP — what DTensor needs ``_StridedShard`` for); dim 1 is whole. Axes
not named replicate. Splits follow ``torch.chunk`` rounding: ``L`` over ``n`` gives chunks of
``ceil(L/n)`` with the remainder last and trailing empty chunks (10 over 4 → 3, 3, 3, 1).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from hyperrl.errors import HyperRLError
from hyperrl.sharding.mesh import Mesh

__all__ = ["Spec", "Box", "chunk_bounds", "dim_intervals", "boxes", "owners", "SpecError"]


class SpecError(HyperRLError, ValueError):
    """An invalid spec, or a spec that does not fit its mesh/shape."""


@dataclass(frozen=True)
class Spec:
    """A sharding spec: per tensor dim, the ordered (outer → inner) mesh axes it is split over; ``()`` whole.
    An axis may appear once; axes not named replicate (see the module doc)."""

    dims: tuple[tuple[str, ...], ...]

    def __post_init__(self):
        seen: list[str] = []
        for d in self.dims:
            if not isinstance(d, tuple):
                raise SpecError(f"spec dims must be tuples of axis names, got {d!r}")
            seen.extend(d)
        dup = sorted({a for a in seen if seen.count(a) > 1})
        if dup:
            raise SpecError(f"spec {self}: mesh axis {dup[0]!r} used twice")

    @staticmethod
    def replicate(ndim: int) -> Spec:
        return Spec(((),) * ndim)

    @staticmethod
    def shard(ndim: int, **dims: tuple[str, ...] | str) -> Spec:
        """``Spec.shard(2, d0=("tp", "fsdp"))`` / ``Spec.shard(2, d1="tp")``."""
        out = [()] * ndim
        for k, axes in dims.items():
            i = int(k.lstrip("d"))
            if not 0 <= i < ndim:
                raise SpecError(f"spec: dim {i} out of range for a {ndim}-d tensor")
            out[i] = (axes,) if isinstance(axes, str) else tuple(axes)
        return Spec(tuple(out))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    def check(self, mesh: Mesh, shape: tuple[int, ...], name: str = "tensor") -> None:
        if len(shape) != self.ndim:
            raise SpecError(f"{name}: spec has {self.ndim} dims but the tensor has shape {list(shape)}")
        for a in self.axes():
            if a not in mesh.names:
                raise SpecError(f"{name}: spec axis {a!r} is not a mesh axis {list(mesh.names)}")

    def __str__(self) -> str:
        return "[" + ", ".join("·".join(d) if d else "R" for d in self.dims) + "]"


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle: ``offsets`` and ``sizes`` per dim (sizes may be 0)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        offs, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, origin: Box) -> Box:
        return Box(tuple(o - p for o, p in zip(self.offsets, origin.offsets)), self.sizes)

    def contains(self, index: tuple[int, ...]) -> bool:
        return all(o <= i < o + s for i, o, s in zip(index, self.offsets, self.sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def chunk_bounds(length: int, n: int, i: int) -> tuple[int, int]:
    """``torch.chunk`` rounding: the ``[lo, hi)`` of chunk ``i`` of ``length`` split ``n`` ways."""
    cs = -(-length // n) if length else 0
    return min(i * cs, length), min((i + 1) * cs, length)


@lru_cache(maxsize=65536)
def dim_intervals(length: int, sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Nested chunking of ``[0, length)`` by axes of ``sizes`` (outer → inner): the interval for
    each mixed-radix dim-coordinate ``k`` (outer axis most significant), in increasing order."""
    out = [(0, length)]
    for n in sizes:
        nxt = []
        for lo, hi in out:
            for i in range(n):
                a, b = chunk_bounds(hi - lo, n, i)
                nxt.append((lo + a, lo + b))
        out = nxt
    return tuple(out)


def _dim_coordinate(spec_axes: tuple[str, ...], coords: dict, mesh: Mesh) -> int:
    k = 0
    for a in spec_axes:
        k = k * mesh.axis_size(a) + coords[a]
    return k


def boxes(spec: Spec, mesh: Mesh, shape: tuple[int, ...], name: str = "tensor") -> dict[int, Box]:
    """Physical rank → the box of the global tensor it holds (replicas share boxes)."""
    spec.check(mesh, tuple(shape), name)
    per_dim = [dim_intervals(L, tuple(mesh.axis_size(a) for a in d)) for L, d in zip(shape, spec.dims)]
    out = {}
    for pos, c in mesh.coords():
        iv = [per_dim[d][_dim_coordinate(spec.dims[d], c, mesh)] for d in range(spec.ndim)]
        out[mesh.ranks[pos]] = Box(tuple(lo for lo, _ in iv), tuple(hi - lo for lo, hi in iv))
    return out


def owners(spec: Spec, mesh: Mesh, shape: tuple[int, ...], index: tuple[int, ...]) -> list[int]:
    """The inverse map: every physical rank holding element ``index`` (sorted)."""
    if len(index) != len(shape) or any(not 0 <= i < n for i, n in zip(index, shape)):
        raise SpecError(f"index {list(index)} is outside shape {list(shape)}")
    spec.check(mesh, tuple(shape))
    want = []
    for L, d, i in zip(shape, spec.dims, index):
        iv = dim_intervals(L, tuple(mesh.axis_size(a) for a in d))
        starts = [lo for lo, _ in iv]
        k = bisect_right(starts, i) - 1  # the last chunk starting at or before i holds it
        digits = []
        for a in reversed(d):
            k, r = divmod(k, mesh.axis_size(a))
            digits.append((a, r))
        want.extend(digits)
    fixed = dict(want)
    return sorted(mesh.ranks[p] for p, c in mesh.coords() if all(c[a] == v for a, v in fixed.items()))

