"""Converters between hyperrl specs and DTensor placements.

hyperrl lists, per tensor dim, the mesh axes sharding it *outer → inner*. DTensor lists one
placement per mesh dim and applies them left to right in mesh order; when a dim's axes are
ordered differently from the mesh (FSDP2 applied on top of TP: ``("tp", "fsdp")`` on a
``(fsdp, tp)`` mesh) the outer-in-spec-but-later-in-mesh axes become a ``split_factor`` of a
``_StridedShard`` on the earlier mesh dim.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyperrl.sharding.mesh import Mesh
from hyperrl.sharding.spec import Spec, SpecError

__all__ = ["to_placements", "from_placements", "dtensor_spec", "is_dtensor", "local"]


def to_placements(spec: Spec, mesh: Mesh) -> list:
    """One DTensor placement per mesh axis (in mesh order) for ``spec``."""
    order = {a: i for i, a in enumerate(mesh.names)}
    out = []
    for a in mesh.names:
        dim = next((d for d, axes in enumerate(spec.dims) if a in axes), None)
        if dim is None:
            out.append(Replicate())
            continue
        axes = spec.dims[dim]
        outer = axes[: axes.index(a)]
        sf = 1
        for b in outer:
            if order[b] > order[a]:
                sf *= mesh.axis_size(b)
        # inner axes earlier in mesh order than an outer one would need a second stride: unsupported
        for b in axes[axes.index(a) + 1:]:
            if order[b] < order[a] and sf > 1:
                raise SpecError(f"spec {spec}: axis order {axes} on dim {dim} has no DTensor placement")
        out.append(_StridedShard(dim, split_factor=sf) if sf > 1 else Shard(dim))
    return out


def from_placements(placements, mesh: Mesh, ndim: int) -> Spec:
    """The hyperrl spec of DTensor ``placements`` (``Shard``, ``_StridedShard``, ``Replicate``)."""
    if len(placements) != len(mesh.names):
        raise SpecError(f"{len(placements)} placements for a {len(mesh.names)}-d mesh {list(mesh.names)}")
    dims: list[list[str]] = [[] for _ in range(ndim)]
    strided: dict[str, int] = {}
    for a, p in zip(mesh.names, placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, Shard | _StridedShard):
            raise SpecError(f"mesh axis {a!r}: placement {p} has no hyperrl spec (only Shard/_StridedShard/Replicate)")
        if not 0 <= p.dim < ndim:
            raise SpecError(f"mesh axis {a!r}: {p} shards dim {p.dim} of a {ndim}-d tensor")
        dims[p.dim].append(a)
        if isinstance(p, _StridedShard) and p.split_factor > 1:
            strided[a] = p.split_factor
    for d, axes in enumerate(dims):
        for a in [x for x in reversed(axes) if x in strided]:
            i = axes.index(a)
            prod, j = 1, i + 1
            while j < len(axes) and prod < strided[a]:
                prod *= mesh.axis_size(axes[j])
                j += 1
            if prod != strided[a]:
                raise SpecError(f"mesh axis {a!r}: split_factor {strided[a]} does not match the later axes on dim {d}")
            axes.insert(j - 1, axes.pop(i))
    return Spec(tuple(tuple(a) for a in dims))


def dtensor_spec(t, meshes: dict | None = None) -> tuple[Mesh, Spec]:
    """A DTensor's mesh and spec on its *root* device mesh — the same on every rank. (FSDP2 over
    the ``dp`` axis of a ``dp × tp`` mesh puts a norm weight on rank 0's ``dp`` sub-mesh (0, 2)
    but on rank 1's (1, 3): planned from the sub-mesh, ranks would plan different things.) Axes
    of the root mesh the tensor's own mesh lacks are replicated. ``meshes`` caches one
    :class:`Mesh` per root."""
    dm = t.device_mesh
    root = dm._get_root_mesh() if hasattr(dm, "_get_root_mesh") else dm
    names = root.mesh_dim_names or tuple(f"d{i}" for i in range(root.ndim))
    meshes = {} if meshes is None else meshes
    mesh = meshes.get(id(root))
    if mesh is None:
        mesh = meshes[id(root)] = Mesh(tuple(zip(names, root.mesh.shape)), tuple(root.mesh.flatten().tolist()))
    if root is dm:
        return mesh, from_placements(t.placements, mesh, t.dim())
    own = dict(zip(dm.mesh_dim_names or (), t.placements))
    if len(own) != dm.ndim or not set(own) <= set(names):
        raise SpecError(f"a tensor's device mesh {dm.mesh_dim_names} is not a named sub-mesh of {names}")
    return mesh, from_placements(tuple(own.get(n, Replicate()) for n in names), mesh, t.dim())


def is_dtensor(t) -> bool:
    """Is ``t`` a ``torch.distributed.tensor.DTensor``?"""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t):
    """A DTensor's local shard (the tensor itself when not sharded)."""
    return t.to_local() if is_dtensor(t) else t
