"""Spec ↔ DTensor placements, checked against real DTensors (and FSDP2 on TP) on a 4-process gloo mesh."""

import pytest
import torch

from hyperrl.sharding import Mesh, Spec, SpecError
from hyperrl.sharding.dtensor import from_placements, to_placements
from tests.dist_helpers import run_gloo

pytestmark = [pytest.mark.dist]

SPECS = [
    ((8, 6), Spec.shard(2, d0=("fsdp", "tp"))),
    ((8, 6), Spec.shard(2, d0=("tp", "fsdp"))),  # FSDP2 on TP: _StridedShard
    ((10, 7), Spec.shard(2, d0="fsdp", d1="tp")),  # uneven: 10/2, 7 -> 4, 3
    ((5, 3), Spec.shard(2, d1="fsdp")),  # uneven with an empty trailing shard? 3/2 -> 2, 1
    ((6, 4), Spec.replicate(2)),
    ((3, 8), Spec.shard(2, d1=("fsdp", "tp"))),
]


def test_round_trip_without_devices():
    mesh = Mesh.of(fsdp=2, tp=2)
    for shape, spec in SPECS:
        assert from_placements(to_placements(spec, mesh), mesh, len(shape)) == spec
    p = to_placements(Spec.shard(2, d0=("tp", "fsdp")), mesh)
    assert type(p[0]).__name__ == "_StridedShard" and p[0].split_factor == 2
    with pytest.raises(SpecError, match="2 placements for a 3-d mesh"):
        from_placements(p, Mesh.of(a=1, fsdp=2, tp=2), 2)


def _check(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from hyperrl.sharding import boxes

    dmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    mesh = Mesh.of(fsdp=2, tp=2)
    bad = []
    for shape, spec in SPECS:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        dt = distribute_tensor(full, dmesh, to_placements(spec, mesh))
        want = full[boxes(spec, mesh, shape)[rank].slices()]
        if not torch.equal(dt.to_local(), want):
            bad.append(str(spec))
        if from_placements(dt.placements, mesh, len(shape)) != spec:
            bad.append("from:" + str(spec))
    # real FSDP2 over a TP-sharded module: the parameter's placements and local shard must agree
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False))
    full_w = model[0].weight.detach().clone()
    parallelize_module(model, dmesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=dmesh["fsdp"])
    w = model[0].weight
    spec = from_placements(w.placements, mesh, 2)
    if spec != Spec.shard(2, d0=("tp", "fsdp")):
        bad.append(f"fsdp2 spec {spec} placements {w.placements}")
    elif not torch.equal(w.to_local(), full_w[boxes(spec, mesh, (8, 6))[rank].slices()]):
        bad.append("fsdp2 local shard")
    return bad


def test_against_real_dtensors_on_gloo():
    res = run_gloo(_check, 4)
    assert all(not bad for bad in res.values()), res
