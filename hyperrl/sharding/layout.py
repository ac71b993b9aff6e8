"""Model layouts: where every tensor of a state dict lives, on the source and destination side.

Source side (the trainer): :class:`Layout`, ``name → Placement(shape, dtype, spec, mesh)``;
each tensor may use its own mesh (e.g. an expert lives on one EP group's sub-mesh).

Destination side (the inference engine): :class:`DstLayout`, ``name → DstParam``. A destination
parameter is the *local concatenation* (along ``cat_dim``) of :class:`Part` s — vLLM's fused
``qkv_proj`` is parts q, k, v; ``gate_up_proj`` is gate, up. Each part is a *virtual* global
tensor tiled by source :class:`Block` s (one block for a plain tensor; ``E`` stacked blocks for
``[E, …]`` experts, in placement order) and split over the destination mesh by a rule
(a :class:`Rule`: :class:`ChunkRule` for ``torch.chunk`` splits; engine-specific rules live with
their engine — :class:`~.vllm.HeadReplicaRule` for kv heads replicated when ``tp ≥ n_kv``).
Virtual extents beyond the blocks (vocab padded to a multiple of 64) are padding: allocated on
the destination (zeros), never sent.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import product
from typing import NamedTuple, Protocol

import torch

from hyperrl.errors import HyperRLError
from hyperrl.sharding.mesh import Mesh
from hyperrl.sharding.spec import Box, Spec, dim_intervals

__all__ = [
    "Placement",
    "Layout",
    "Block",
    "ChunkRule",
    "Rule",
    "Part",
    "DstParam",
    "DstLayout",
    "Piece",
    "Demand",
    "LayoutError",
    "check_compatible",
    "plain_destination",
]


class LayoutError(HyperRLError, ValueError):
    """Mismatched or incomplete layouts; the message lists the offending names."""


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class Placement:
    """Where one source tensor lives: its global ``shape`` and ``dtype``, and its ``spec`` (the mesh
    axes each dim is split over) on ``mesh``. Checked at construction: every spec axis is a mesh
    axis and the spec has one entry per tensor dim."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: Spec
    mesh: Mesh

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        # checked at construction (an axis not on the mesh, a spec of another rank than the tensor)
        where = f"placement of a {list(self.shape)} tensor on mesh {list(self.mesh.names)}"
        self.spec.check(self.mesh, self.shape, where)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


class Layout(Mapping):
    """Immutable ``name → Placement`` for a whole source state dict."""

    def __init__(self, placements: Mapping[str, Placement]):
        self._p = dict(placements)  # each Placement checked its spec against its mesh and shape when made

    def __getitem__(self, k: str) -> Placement:
        return self._p[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._p)

    def __len__(self) -> int:
        return len(self._p)

    # the dict's own methods, not Mapping's Python-level mixins (planning looks up 10⁵ names)
    def __contains__(self, k) -> bool:
        return k in self._p

    def get(self, k, default=None):
        return self._p.get(k, default)

    def keys(self):
        return self._p.keys()

    def values(self):
        return self._p.values()

    def items(self):
        return self._p.items()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._p.values())

    def ranks(self) -> set[int]:
        return {r for p in self._p.values() for r in p.mesh.ranks}


# ----------------------------------------------------------------------------- destination rules


class Rule(Protocol):
    """How a part's virtual tensor splits over the destination mesh: the box each mesh position
    holds, and a check that the rule fits the part (frozen and hashable: boxes are cached)."""

    def box(self, shape: tuple[int, ...], mesh: Mesh, coords: dict) -> Box: ...

    def check(self, shape: tuple[int, ...], mesh: Mesh, where: str) -> None: ...


@dataclass(frozen=True)
class ChunkRule:
    """Split the virtual tensor by ``spec`` (ordered mesh axes per dim, ``torch.chunk`` rounding)."""

    spec: Spec

    def box(self, shape: tuple[int, ...], mesh: Mesh, coords: dict) -> Box:
        offs, sizes = [], []
        for L, axes in zip(shape, self.spec.dims):
            iv = dim_intervals(L, tuple(mesh.axis_size(a) for a in axes))
            k = 0
            for a in axes:
                k = k * mesh.axis_size(a) + coords[a]
            offs.append(iv[k][0])
            sizes.append(iv[k][1] - iv[k][0])
        return Box(tuple(offs), tuple(sizes))

    def check(self, shape: tuple[int, ...], mesh: Mesh, where: str) -> None:
        """The rule fits a part of ``shape`` on ``mesh`` (error names ``where``)."""
        if self.spec.ndim != len(shape):
            raise LayoutError(f"{where}: rule spec {self.spec} has {self.spec.ndim} dims, the part has {len(shape)}")
        bad = [a for a in self.spec.axes() if a not in mesh.names]
        if bad:
            raise LayoutError(f"{where}: rule axis {bad[0]!r} is not a destination mesh axis {list(mesh.names)}")


@lru_cache(maxsize=4096)
def _rule_boxes(rule, shape: tuple[int, ...], mesh: Mesh) -> tuple[Box, ...]:
    """The rule's box at every mesh position (cached: every layer shares it). A :class:`ChunkRule` — every
    engine parameter but a few — has its per-dim intervals computed once, not once per position."""
    if type(rule) is ChunkRule:
        names, size = mesh.names, mesh.axis_size
        ivs = [(dim_intervals(L, tuple(size(a) for a in axes)), [(names.index(a), size(a)) for a in axes])
               for L, axes in zip(shape, rule.spec.dims)]
        out = []
        for c in product(*(range(n) for n in mesh.shape)):
            offs, sizes = [], []
            for iv, axes in ivs:
                k = 0
                for i, n in axes:
                    k = k * n + c[i]
                lo, hi = iv[k]
                offs.append(lo)
                sizes.append(hi - lo)
            out.append(Box(tuple(offs), tuple(sizes)))
        return tuple(out)
    return tuple(rule.box(shape, mesh, c) for _, c in mesh.coords())


@dataclass(frozen=True)
class Block:
    """Source tensor ``src`` placed in a part's virtual tensor at ``offset``. With ``stacked``,
    the virtual tensor has one extra leading dim and the block sits at index ``offset[0]``. With
    ``window``, the part is a window of the source (``offset`` ≤ 0: the source extends past the part
    on both sides and only the part's extent is delivered — vLLM's ``QKVParallelLinear`` taking its q,
    k and v heads from a checkpoint tensor that already fuses them, :func:`Part.window`)."""

    src: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]  # the source tensor's shape
    stacked: bool = False
    window: bool = False

    def virtual_box(self) -> Box:
        sizes = ((1,) if self.stacked else ()) + tuple(self.shape)
        return Box(tuple(self.offset), sizes)


@dataclass(frozen=True)
class Part:
    """One part of a destination parameter: a virtual global tensor of ``shape`` tiled by source ``blocks``
    (extents no block covers are padding) and split over the destination mesh by ``rule``."""

    shape: tuple[int, ...]  # virtual global shape (may exceed the blocks: padding)
    blocks: tuple[Block, ...]
    rule: Rule

    @staticmethod
    def plain(src: str, shape, rule, pad_shape=None) -> Part:
        shape = tuple(shape)
        return Part(tuple(pad_shape or shape), (Block(src, (0,) * len(shape), shape),), rule)

    @staticmethod
    def window(src: str, shape, dim: int, lo: int, n: int, rule) -> Part:
        """Rows ``[lo, lo + n)`` along ``dim`` of source ``src`` (of ``shape``) as a part of their own — one
        of the q / k / v thirds of a tensor the checkpoint already fuses (``attn.qkv``), which a tensor-parallel
        engine splits head-wise third by third."""
        shape = tuple(shape)
        if not 0 <= lo and lo + n <= shape[dim]:
            raise LayoutError(f"{src}: window [{lo}, {lo + n}) of dim {dim} lies outside its shape {list(shape)}")
        offset = tuple(-lo if d == dim else 0 for d in range(len(shape)))
        part_shape = tuple(n if d == dim else k for d, k in enumerate(shape))
        return Part(part_shape, (Block(src, offset, shape, window=True),), rule)

    @staticmethod
    def stacked(srcs: list[str], block_shape, rule, order: list[int] | None = None) -> Part:
        """``E`` same-shaped sources stacked on a new dim 0; ``order[e]`` is expert e's slot."""
        block_shape = tuple(block_shape)
        slots = order if order is not None else list(range(len(srcs)))
        blocks = tuple(Block(s, (slot,) + (0,) * len(block_shape), block_shape, True) for s, slot in zip(srcs, slots))
        return Part((len(srcs),) + block_shape, blocks, rule)


@dataclass(frozen=True)
class DstParam:
    """A destination parameter on ``mesh``: the local concatenation along ``cat_dim`` of its ``parts``
    (one for a plain tensor; e.g. q, k, v for a fused ``qkv_proj``), in ``dtype``."""

    dtype: torch.dtype
    mesh: Mesh
    parts: tuple[Part, ...]
    cat_dim: int = 0

    @cached_property
    def local_boxes(self) -> list[list[Box]]:
        """``[position][part]`` box of each part's virtual tensor held at that mesh position."""
        per_part = [_rule_boxes(p.rule, p.shape, self.mesh) for p in self.parts]
        return [list(bs) for bs in zip(*per_part)]

    def local_shape(self, pos: int) -> tuple[int, ...]:
        bs = self.local_boxes[pos]
        shape = list(bs[0].sizes)
        if len(self.parts) > 1:
            shape[self.cat_dim] = sum(b.sizes[self.cat_dim] for b in bs)
        return tuple(shape)

    @cached_property
    def padded(self) -> bool:
        """Some elements come from no source (vocabulary padding): they are zeros, never sent."""
        return any(math.prod(p.shape) > sum(math.prod(b.shape) for b in p.blocks) for p in self.parts)

    def cat_offset(self, pos: int, part: int) -> int:
        return sum(b.sizes[self.cat_dim] for b in self.local_boxes[pos][:part])


class Piece(tuple):
    """``(dst_pos, src_box, dst_offset)``: the destination mesh position needs ``src_box`` (global
    coordinates of the source tensor) at ``dst_offset`` (+ the demand's shift) in its local param."""

    __slots__ = ()

    def __new__(cls, dst_pos: int, src_box: Box, dst_offset: tuple[int, ...]):
        return tuple.__new__(cls, (dst_pos, src_box, dst_offset))

    dst_pos = property(lambda s: s[0])
    src_box = property(lambda s: s[1])
    dst_offset = property(lambda s: s[2])


_new_tuple = tuple.__new__


class Demand(NamedTuple):
    """What one destination parameter needs from one source tensor: a shared ``pattern`` of pieces
    plus a ``shift`` added to every piece's destination offset (an expert's slot). (A named tuple: a DeepSeek-V3
    layout's :meth:`DstLayout.demands` makes 45,000 of them; the planner makes none — it files the fields of each as
    :meth:`DstLayout.demanded_parts` yields them.)"""

    param: str
    pattern: tuple[Piece, ...]
    shift: tuple[int, ...]


def _check_param(name: str, p: DstParam) -> None:
    """A destination parameter that would silently lose or misplace data is an error naming it:
    a rule that does not fit its part (each rule's ``check``: dims, mesh axes, kv-head rows), a
    block outside its part's virtual extent (an expert slot outside its stack, a padded extent
    smaller than the tensor), two blocks in one slot."""
    for i, part in enumerate(p.parts):
        srcs = [b.src for b in part.blocks]
        names = ", ".join(repr(n) for n in srcs[:4]) + (f", … ({len(srcs)} in all)" if len(srcs) > 4 else "")
        where = f"{name} (part {i}, shape {list(part.shape)}; from {names})"
        part.rule.check(part.shape, p.mesh, where)
        seen: dict[tuple, str] = {}
        L = part.shape
        for b in part.blocks:
            sizes = (1, *b.shape) if b.stacked else b.shape
            if b.window:  # the part lies inside its one source
                if len(part.blocks) != 1 or len(b.offset) != len(L) or len(sizes) != len(L) or \
                        not all(o <= 0 and m <= o + n for o, n, m in zip(b.offset, sizes, L)):
                    raise LayoutError(f"{where}: window of {b.src!r} at {list(b.offset)} (source {list(sizes)}) "
                                      f"does not cover the part, or shares it with other blocks")
                continue
            if len(b.offset) != len(L) or len(sizes) != len(L) or \
                    not all(0 <= o and o + n <= m for o, n, m in zip(b.offset, sizes, L)):
                raise LayoutError(f"{where}: block {b.src!r} at {list(b.offset)} of size {list(sizes)} lies "
                                  f"outside the part (an expert slot outside its stack, or a padded extent smaller "
                                  f"than the tensor): it would never be sent")
            if b.offset in seen:
                raise LayoutError(f"{where}: blocks {seen[b.offset]!r} and {b.src!r} share the slot {list(b.offset)}")
            seen[b.offset] = b.src


@dataclass
class DstLayout:
    """``name → DstParam`` for the inference engine's parameters (each checked at construction)."""

    params: dict[str, DstParam] = field(default_factory=dict)

    def __post_init__(self):
        for name, p in self.params.items():
            _check_param(name, p)

    def __len__(self) -> int:
        return len(self.params)

    def ranks(self) -> set[int]:
        return {r for p in self.params.values() for r in p.mesh.ranks}

    def blocks(self) -> Iterator[tuple[str, DstParam, int, Part, Block]]:
        """Every ``(param name, param, part index, part, block)`` — the one walk over the layout."""
        for name, p in self.params.items():
            for j, part in enumerate(p.parts):
                for b in part.blocks:
                    yield name, p, j, part, b

    def sources(self) -> dict[str, tuple[int, ...]]:
        """Every source tensor the destination reads, with the shape it expects."""
        return {b.src: b.shape for _, _, _, _, b in self.blocks()}

    def demands(self) -> dict[str, list[Demand]]:
        """``src name → [Demand]``, in :meth:`demanded_parts` order."""
        out: defaultdict[str, list[Demand]] = defaultdict(list)
        for name, _, blocks, results in self.demanded_parts():
            for block, (pattern, shift) in zip(blocks, results):  # tuple.__new__: 45,000 of them
                out[block.src].append(_new_tuple(Demand, (name, pattern, shift)))
        return dict(out)

    def demanded_parts(self) -> Iterator[tuple[str, DstParam, Sequence[Block], list[tuple[tuple[Piece, ...], tuple]]]]:
        """Per part of every parameter, ``(param name, param, blocks, [(pattern, shift)])``: block ``i`` of the part
        needs pattern ``i`` at shift ``i`` — the :class:`Demand` of its source, not yet made (a planner groups them as
        they come). Patterns are built once per (part, elementary slot range) and shared by every block in it, so
        ``E`` stacked experts cost ``O(#positions)``, not ``O(E·#positions)``; equal patterns are one object."""
        interned: dict[tuple, tuple] = {}  # equal patterns (e.g. of every layer) become one object
        # the same pattern object again (a stacked part's slots share one): no re-hashing of its 256 pieces —
        # kept with the object, so that its id cannot be reused while this runs
        by_id: dict[int, tuple[tuple, tuple]] = {}

        def intern(pat: tuple) -> tuple:
            hit = by_id.get(id(pat))
            if hit is None:
                hit = by_id[id(pat)] = (pat, interned.setdefault(pat, pat))
            return hit[1]

        by_signature: dict[tuple, list] = {}  # params equal but for source names (every layer) share patterns
        for name, param in self.params.items():
            sig = (param.mesh, param.cat_dim, tuple(
                (p.shape, p.rule, tuple((b.offset, b.shape, b.stacked, b.window) for b in p.blocks))
                for p in param.parts))
            cached = by_signature.get(sig)
            if cached is None:  # patterns interned once here, not per block
                cached = by_signature[sig] = [[(intern(pat), sh) for _, pat, sh in _part_patterns(param, j, part)]
                                              for j, part in enumerate(param.parts)]
            for part, results in zip(param.parts, cached):
                blocks = sorted(part.blocks, key=lambda b: b.offset[0]) if part.blocks and part.blocks[0].stacked \
                    else part.blocks
                yield name, param, blocks, results


def _part_patterns(param: DstParam, j: int, part: Part):
    """Yield ``(block, pattern, shift)`` for each block of part ``j`` of ``param``."""
    mesh = param.mesh
    boxes = [param.local_boxes[pos][j] for pos in range(mesh.size)]
    cat = param.cat_dim
    if not part.blocks:
        return
    stacked = part.blocks[0].stacked
    if not stacked:
        for block in part.blocks:
            vb = block.virtual_box()
            pieces = []
            for pos, rb in enumerate(boxes):
                inter = rb.intersect(vb)
                if inter is None:
                    continue
                local = list(inter.relative_to(rb).offsets)
                if len(param.parts) > 1:
                    local[cat] += param.cat_offset(pos, j)
                pieces.append(Piece(pos, inter.relative_to(vb), tuple(local)))
            yield block, tuple(pieces), (0,) * len(vb.offsets)
        return
    # stacked: sweep the slot dim; slots with the same covering positions share one pattern
    cuts = sorted({0, part.shape[0], *(b.offsets[0] for b in boxes), *(b.offsets[0] + b.sizes[0] for b in boxes)})
    cache: dict[int, tuple] = {}
    for block in sorted(part.blocks, key=lambda b: b.offset[0]):
        slot = block.offset[0]
        seg = bisect_right(cuts, slot) - 1
        if seg not in cache:
            pieces = []
            for pos, rb in enumerate(boxes):
                if not rb.offsets[0] <= slot < rb.offsets[0] + rb.sizes[0]:
                    continue
                inner = Box(rb.offsets[1:], rb.sizes[1:]).intersect(Box((0,) * len(block.shape), block.shape))
                if inner is None:
                    continue
                local = [-rb.offsets[0]] + [o - r for o, r in zip(inner.offsets, rb.offsets[1:])]
                if len(param.parts) > 1:
                    local[cat] += param.cat_offset(pos, j)
                pieces.append(Piece(pos, inner, tuple(local)))
            cache[seg] = tuple(pieces)
        yield block, cache[seg], (slot,) + (0,) * len(block.shape)


def check_compatible(src: Layout, dst: DstLayout) -> None:
    """Names, shapes and dtypes agree; raises :class:`LayoutError` listing every mismatch."""
    have = src._p
    need, dtypes, bad_shape = {}, {}, []
    for pname, p in dst.params.items():  # the walk of DstLayout.blocks, inlined (45,000 blocks)
        dtype = p.dtype
        for part in p.parts:
            for b in part.blocks:
                need[b.src] = b.shape
                pl = have.get(b.src)
                if pl is None:
                    continue
                if pl.shape != b.shape:
                    bad_shape.append(f"{b.src}: source {list(pl.shape)} vs destination {list(b.shape)}")
                if pl.dtype != dtype:
                    dtypes[b.src] = f"{b.src}: source {pl.dtype} vs destination {pname} {dtype}"
    problems = []
    if len(need) != len(have) or not need.keys() == have.keys():
        missing, extra = sorted(need.keys() - have.keys()), sorted(have.keys() - need.keys())
        if missing:
            problems.append(f"destination reads tensors the source lacks: {missing[:5]}"
                            f"{' …' if len(missing) > 5 else ''} ({len(missing)} in all)")
        if extra:
            problems.append(f"source tensors no destination parameter reads: {extra[:5]}"
                            f"{' …' if len(extra) > 5 else ''} ({len(extra)} in all)")
    if bad_shape:
        problems.append("shape mismatch: " + "; ".join(list(dict.fromkeys(bad_shape))[:5]))
    if dtypes:
        problems.append("dtype mismatch: " + "; ".join(list(dtypes.values())[:5]))
    if problems:
        raise LayoutError("layouts do not match — " + " | ".join(problems))


def plain_destination(tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype, Spec]], mesh: Mesh) -> DstLayout:
    """A destination where each source tensor is its own parameter, split by a chunk spec."""
    return DstLayout({n: DstParam(dt, mesh, (Part.plain(n, shape, ChunkRule(spec)),)) for n, (shape, dt, spec) in
                      tensors.items()})
