"""The publication time model: hand-computed predictions, the planner choosing by it, and parsing."""

import pytest
import torch

from hyperrl.sharding import Layout, Mesh, Placement, Spec, plain_destination, reshard_plan
from hyperrl.sharding.timing import Links, parse_links, predict


def _one(src_mesh, dst_mesh, n=4, spec_src=None, spec_dst=None):
    src = Layout({"w": Placement((n,), torch.float32, spec_src or Spec.replicate(1), src_mesh)})
    dst = plain_destination({"w": ((n,), torch.float32, spec_dst or Spec.replicate(1))}, dst_mesh)
    return src, dst


def test_prediction_by_hand():
    # 16 bytes from rank 0 to rank 1. Other nodes (1 rank per node): 16 B / 8 B/s + 0.5 s = 2.5 s;
    # same node: 16 / 16 + 0.5 = 1.5 s
    src, dst = _one(Mesh.of(r=1), Mesh.of(r=1, offset=1))
    plan = reshard_plan(src, dst)
    assert predict(plan, Links(16, 8, 0.5, ranks_per_node=1)).seconds == pytest.approx(2.5)
    assert predict(plan, Links(16, 8, 0.5, ranks_per_node=2)).seconds == pytest.approx(1.5)
    # colocated: a local copy, free by default; at 4 B/s + 0.25 s per copy: 4.25 s
    local = reshard_plan(*_one(Mesh.of(r=1), Mesh.of(r=1)))
    assert predict(local, Links(16, 8, 0.5)).seconds == 0.0
    assert predict(local, Links(16, 8, 0.5, local=4, copy_latency=0.25)).seconds == pytest.approx(4.25)
    # rank 0 sends its half to rank 1 while rank 1 sends its half to rank 0 (8 B each way, 1 message):
    # full duplex 8/16 + 0.5 = 1 s; half duplex both directions add up: 2 s
    swap = reshard_plan(*_one(Mesh.of(r=2), Mesh.of(r=2), spec_src=Spec.shard(1, d0="r"),
                              spec_dst=Spec.shard(1, d0="r")))
    assert predict(swap, Links(16, 16)).seconds == 0.0  # each rank holds its own half: all local
    rev = Layout({"w": Placement((4,), torch.float32, Spec.shard(1, d0="r"), Mesh.of(r=2, ranks=(1, 0)))})
    cross = reshard_plan(rev, plain_destination({"w": ((4,), torch.float32, Spec.shard(1, d0="r"))}, Mesh.of(r=2)))
    assert predict(cross, Links(16, 16, 0.5)).seconds == pytest.approx(1.0)
    assert predict(cross, Links(16, 16, 0.5, duplex=False)).seconds == pytest.approx(2.0)


def test_fan_out_phases_add_up_and_auto_picks_the_faster_plan():
    # a 1 MiB tensor on node 0 (ranks 0, 1), read whole by 4 replicas on node 1 (ranks 4..7)
    src, dst = _one(Mesh.of(r=2), Mesh.of(r=4, offset=4), n=1 << 18)
    slow_inter = Links(intra=100e9, inter=1e9, ranks_per_node=4)  # crossing nodes is the cost
    star, tree = reshard_plan(src, dst), reshard_plan(src, dst, fan_out=True)
    p_star, p_tree = predict(star, slow_inter), predict(tree, slow_inter)
    assert len(p_tree.phase_seconds) == 3 and p_tree.seconds == pytest.approx(sum(p_tree.phase_seconds))
    assert p_tree.seconds < p_star.seconds
    assert reshard_plan(src, dst, fan_out="auto", links=slow_inter).fan_out is True
    fast_inter = Links(intra=1e9, inter=100e9, ranks_per_node=4)  # forwarding inside node 1 is the cost
    assert reshard_plan(src, dst, fan_out="auto", links=fast_inter).fan_out is False
    with pytest.raises(ValueError, match="needs links"):
        reshard_plan(src, dst, fan_out="auto")


def test_links_prefer_a_source_replica_on_the_receivers_node():
    # the tensor is replicated on ranks 0 (node 0) and 2 (node 1); the reader is rank 3 (node 1)
    src = Layout({"w": Placement((8,), torch.float32, Spec.replicate(1), Mesh.of(r=2, ranks=(0, 2)))})
    dst = plain_destination({"w": ((8,), torch.float32, Spec.replicate(1))}, Mesh.of(r=1, ranks=(3,)))
    links = Links(100e9, 1e9, ranks_per_node=2)
    assert {t.src_rank for t in reshard_plan(src, dst, links=links)} == {2}
    far = Layout({"w": Placement((8,), torch.float32, Spec.replicate(1), Mesh.of(r=1, ranks=(0,)))})
    assert predict(reshard_plan(src, dst, links=links), links).seconds < predict(reshard_plan(far, dst), links).seconds
    # without links the sender rotates with the piece: the first replica here, across nodes
    assert {t.src_rank for t in reshard_plan(src, dst)} == {0}


def test_parse_links_and_errors():
    links = parse_links("intra=400GB/s,inter=50g", ranks_per_node=4, latency="5us")
    assert (links.intra, links.inter, links.ranks_per_node) == (400e9, 50e9, 4)
    assert links.latency == pytest.approx(5e-6)
    assert parse_links("inter=2.5e10").intra == 2.5e10  # one given: both
    with pytest.raises(ValueError, match="expected intra=…,inter=…"):
        parse_links("fast=1")
    with pytest.raises(ValueError, match="expected a rate"):
        parse_links("intra=quick")
    with pytest.raises(ValueError, match="--latency"):
        parse_links("intra=1g", latency="soon")
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        Links(0, 1)


@pytest.mark.slow
def test_cli_predicts_and_auto_needs_bandwidth():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hyperrl.cli", "plan", "--model", "qwen3-4b", "--trainer", "fsdp=16",
           "--rollout", "tp=4,dp=4"]
    out = subprocess.run(cmd + ["--fan-out", "auto", "--bandwidth", "intra=400GB/s,inter=25GB/s", "--latency", "5us",
                                "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    info = json.loads(out.stdout)
    assert info["predicted_s"] > 0 and isinstance(info["fan_out"], bool)
    bad = subprocess.run(cmd + ["--fan-out", "auto"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--bandwidth" in bad.stderr
