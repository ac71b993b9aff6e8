import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.sharding import Box, Mesh, MeshError, Spec, SpecError, boxes, chunk_bounds, dim_intervals, owners


def test_chunk_rounding_matches_torch_chunk():
    # 10 over 4 -> 3, 3, 3, 1 ; 2 over 4 -> 1, 1, 0, 0 (trailing empty shards)
    assert [b - a for a, b in (chunk_bounds(10, 4, i) for i in range(4))] == [3, 3, 3, 1]
    assert [b - a for a, b in (chunk_bounds(2, 4, i) for i in range(4))] == [1, 1, 0, 0]
    for L in range(0, 30):
        for n in range(1, 9):
            got = [b - a for a, b in (chunk_bounds(L, n, i) for i in range(n))]
            want = [c.shape[0] for c in torch.arange(L).chunk(n)] if L else []
            assert got[: len(want)] == want and all(x == 0 for x in got[len(want):])


def test_mesh_and_spec_errors():
    with pytest.raises(MeshError, match="used twice"):
        Mesh((("tp", 2), ("tp", 2)), (0, 1, 2, 3))
    with pytest.raises(MeshError, match="4 needed"):
        Mesh((("dp", 2), ("tp", 2)), (0, 1, 2))
    with pytest.raises(SpecError, match="'tp' used twice"):
        Spec((("tp",), ("tp",)))
    m = Mesh.of(dp=2, tp=2)
    with pytest.raises(SpecError, match="'ep' is not a mesh axis"):
        boxes(Spec.shard(2, d0="ep"), m, (4, 4))
    with pytest.raises(SpecError, match="spec has 2 dims"):
        boxes(Spec.shard(2, d0="tp"), m, (4, 4, 4))


def test_strided_order_boxes():
    # dim 0 split first by tp (2), then each tp chunk by fsdp (2): rows 8 ->
    # (tp0,fsdp0)=0:2 (tp0,fsdp1)=2:4 (tp1,fsdp0)=4:6 (tp1,fsdp1)=6:8 ; mesh is (fsdp, tp)
    m = Mesh.of(fsdp=2, tp=2)
    b = boxes(Spec.shard(2, d0=("tp", "fsdp")), m, (8, 3))
    # rank = fsdp*2 + tp
    assert b[0] == Box((0, 0), (2, 3)) and b[2] == Box((2, 0), (2, 3))
    assert b[1] == Box((4, 0), (2, 3)) and b[3] == Box((6, 0), (2, 3))


@st.composite
def mesh_spec_shape(draw):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    sizes = {n: draw(st.integers(1, 3)) for n in names}
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    dims = [[] for _ in range(ndim)]
    for n in draw(st.permutations(names)):
        d = draw(st.integers(-1, ndim - 1))
        if d >= 0:
            dims[d].append(n)
    perm = draw(st.permutations(range(Mesh.of(**sizes).size)))
    return Mesh.of(ranks=[10 + p for p in perm], **sizes), Spec(tuple(tuple(d) for d in dims)), shape


@given(mesh_spec_shape())
def test_boxes_tile_tensor_per_replica_and_owners_inverse(msh):
    mesh, spec, shape = msh
    b = boxes(spec, mesh, shape)
    assert set(b) == set(mesh.ranks)
    numel = 1
    for s in shape:
        numel *= s
    # every element is held by the same number of ranks (the replication factor)
    count = torch.zeros(shape, dtype=torch.int64)
    for box in b.values():
        count[box.slices()] += 1
    rep = mesh.size
    for d in spec.dims:
        for a in d:
            rep //= mesh.axis_size(a)
    if numel:
        assert (count == rep).all()
        idx = tuple(s - 1 for s in shape)
        assert owners(spec, mesh, shape, idx) == sorted(r for r, box in b.items() if box.contains(idx))
    # each dim's intervals are exactly torch.chunk applied recursively
    for L, axes in zip(shape, spec.dims):
        iv = dim_intervals(L, tuple(mesh.axis_size(a) for a in axes))
        assert all(a <= b_ for a, b_ in iv) and sum(b_ - a for a, b_ in iv) == L
