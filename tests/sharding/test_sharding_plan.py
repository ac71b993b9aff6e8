import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.sharding import (
    Block,
    DstLayout,
    Layout,
    LayoutError,
    Mesh,
    Placement,
    PlanError,
    Spec,
    boxes,
    plain_destination,
    reshard_plan,
    verify,
)
from hyperrl.sharding.models import MODELS, hf_tensor_shapes, trainer_layout
from hyperrl.sharding.plan import Plan
from hyperrl.sharding.simulate import expected_destination, random_state, simulate
from hyperrl.sharding.vllm import rollout_layout


def _random_spec(draw, names, ndim):
    dims = [[] for _ in range(ndim)]
    for n in draw(st.permutations(names)):
        d = draw(st.integers(-1, ndim - 1))
        if d >= 0:
            dims[d].append(n)
    return Spec(tuple(tuple(d) for d in dims))


@st.composite
def layouts(draw):
    src_sizes = {"f": draw(st.integers(1, 4)), "t": draw(st.integers(1, 2))}
    dst_sizes = {"d": draw(st.integers(1, 2)), "p": draw(st.integers(1, 3))}
    n_src = src_sizes["f"] * src_sizes["t"]
    n_dst = dst_sizes["d"] * dst_sizes["p"]
    # overlapping (colocated) or disjoint physical rank sets, in a random order
    pool = list(range(n_src + n_dst))
    src_ranks = draw(st.permutations(pool))[:n_src]
    dst_ranks = draw(st.permutations(pool))[:n_dst] if draw(st.booleans()) else list(range(100, 100 + n_dst))
    src_mesh = Mesh.of(ranks=src_ranks, **src_sizes)
    dst_mesh = Mesh.of(ranks=dst_ranks, **dst_sizes)
    src, dst = {}, {}
    for i in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
        src[f"t{i}"] = Placement(shape, torch.float32, _random_spec(draw, ["f", "t"], ndim), src_mesh)
        dst[f"t{i}"] = (shape, torch.float32, _random_spec(draw, ["d", "p"], ndim))
    return Layout(src), plain_destination(dst, dst_mesh)


def _brute_force_recv_min(src: Layout, dst: DstLayout) -> int:
    """Label every element; count the (dst rank, element) pairs whose rank does not hold it."""
    total = 0
    for name, p in dst.params.items():
        pl = src[name]
        held = {r: b for r, b in boxes(pl.spec, pl.mesh, pl.shape).items()}
        for pos, (_, c) in enumerate(p.mesh.coords()):
            rank = p.mesh.ranks[pos]
            need = p.parts[0].rule.box(pl.shape, p.mesh, c)
            mask = torch.zeros(pl.shape, dtype=torch.bool)
            mask[need.slices()] = True
            if rank in held:
                mask[held[rank].slices()] = False
            total += int(mask.sum()) * pl.itemsize
    return total


@given(layouts(), st.booleans())
def test_random_plans_verify_and_deliver_every_element(lay, fan_out):
    src, dst = lay
    plan = reshard_plan(src, dst, fan_out=fan_out)
    verify(plan)
    full = random_state(src)
    got, want = simulate(plan, full), expected_destination(dst, full)
    for rank, params in want.items():
        for name, t in params.items():
            assert torch.equal(got[rank][name], t), (rank, name)
    s = plan.stats()
    assert s.wire_bytes == s.recv_min_bytes == _brute_force_recv_min(src, dst)
    if fan_out:
        assert s.egress_bytes == s.src_min_bytes
    assert s.egress_bytes >= s.src_min_bytes


def _plan_for(model, trainer, rollout):
    cfg = MODELS[model]
    src = trainer_layout(cfg, dtype=torch.float32, **trainer)
    dst = rollout_layout(cfg, dtype=torch.float32, **rollout)
    return src, dst


@pytest.mark.parametrize("model, trainer, rollout", [
    ("qwen3-tiny", dict(fsdp=4), dict(tp=2, dp=2, offset=4)),  # dense, padded vocab, fused qkv (tp = n_kv)
    ("qwen3-tiny", dict(fsdp=2, tp=2), dict(tp=4, dp=1)),  # strided FSDP+TP source, kv replicated (tp > n_kv)
    ("qwen3-moe-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=2, offset=4)),  # stacked experts, TP-sharded
    ("qwen3-moe-tiny", dict(fsdp=1, ep=2, tp=2), dict(tp=2, dp=2, ep=4, expert_placement="round_robin")),
    ("deepseek-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=2, ep=4)),  # MLA fused_qkv_a, shared experts, linear EP
])
@pytest.mark.parametrize("fan_out", [False, True])
def test_model_layouts_exact(model, trainer, rollout, fan_out):
    src, dst = _plan_for(model, trainer, rollout)
    plan = reshard_plan(src, dst, fan_out=fan_out)
    verify(plan)
    full = random_state(src, seed=1)
    got, want = simulate(plan, full), expected_destination(dst, full)
    for rank, params in want.items():
        for name, t in params.items():
            assert torch.equal(got[rank][name], t), (rank, name)
    s = plan.stats()
    assert s.wire_bytes == s.recv_min_bytes
    if fan_out:
        assert s.egress_bytes == s.src_min_bytes


@pytest.mark.parametrize("model, trainer, rollout", [
    ("qwen3-tiny", dict(fsdp=2, tp=2), dict(tp=4, dp=1)),
    ("qwen3-moe-tiny", dict(fsdp=1, ep=2, tp=2), dict(tp=2, dp=2, ep=4, expert_placement="round_robin")),
    ("deepseek-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=2, ep=4)),
    ("qwen2.5-vl-tiny", dict(fsdp=2), dict(tp=4)),  # the vision tower's fused qkv: a tensor read by several blocks
])
def test_the_plans_order_is_a_walk_over_the_tensors_by_name(model, trainer, rollout):
    """The planner groups demands as the destination makes them; its order is still that of a walk over the source
    tensors by name (each tensor's Demands in the destination's order), every member in the group of its placement,
    pattern and destination mesh, the groups in the order of their first member — built here from ``demands()``."""
    src, dst = _plan_for(model, trainer, rollout)
    plan = reshard_plan(src, dst)
    demands = dst.demands()
    want: dict = {}
    for tensor in sorted(demands):
        pl = src[tensor]
        for d in demands[tensor]:
            # meshes and patterns by identity, as the planner keys them (equal patterns are one object in a walk)
            key = (pl.shape, pl.spec, id(pl.mesh), pl.dtype, id(d.pattern), id(dst.params[d.param].mesh))
            want.setdefault(key, []).append((tensor, d))
    assert [g.members for g in plan.groups] == list(want.values())
    assert len(plan.groups) < sum(len(ds) for ds in demands.values())  # some groups have several members


def test_tensor_counts_from_config_numbers():
    assert len(hf_tensor_shapes(MODELS["qwen3-4b"])) == 398
    assert len(hf_tensor_shapes(MODELS["qwen3-30b-a3b"])) == 18_867
    assert len(hf_tensor_shapes(MODELS["deepseek-v3"])) == 45_395
    routed = [n for n in hf_tensor_shapes(MODELS["deepseek-v3"]) if ".experts." in n and "shared" not in n]
    assert len(routed) == 44_544


def test_qwen3_30b_full_gather_is_8x_minimum():
    # REFERENCE: Qwen3-30B-A3B -> TP8 x DP2: ~114 GiB needed vs ~910 GiB with full-gather + broadcast
    src, dst = _plan_for("qwen3-30b-a3b", dict(fsdp=8, ep=8), dict(tp=8, dp=2, offset=64))
    src = trainer_layout(MODELS["qwen3-30b-a3b"], fsdp=8, ep=8)
    dst = rollout_layout(MODELS["qwen3-30b-a3b"], tp=8, dp=2, offset=64)
    s = reshard_plan(src, dst).stats()
    assert 110 < s.recv_min_bytes / 2**30 < 118
    assert 7.5 < s.full_gather_bytes / s.wire_bytes < 8.5


def test_expert_identity_memoised():
    src = trainer_layout(MODELS["qwen3-moe-tiny"], fsdp=2, ep=2)
    dst = rollout_layout(MODELS["qwen3-moe-tiny"], tp=2, dp=2, offset=4)
    plan = reshard_plan(src, dst)
    # 2 layers x 8 experts x 3 projections share a handful of geometry groups
    expert_groups = [g for g in plan.groups if ".experts." in g.members[0][0]]
    assert sum(len(g.members) for g in expert_groups) == 2 * 8 * 3
    assert len(expert_groups) <= 2 * 3 * 2  # (ep group) x (gate/up/down) x (src mesh)


def test_bad_layouts_named():
    src = trainer_layout(MODELS["qwen3-tiny"], fsdp=2)
    dst = rollout_layout(MODELS["qwen3-tiny"], tp=2)
    missing = Layout({k: v for k, v in src.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(LayoutError, match=r"lacks: \['model.layers.1.self_attn.k_proj.weight'\]"):
        reshard_plan(missing, dst)
    extra = Layout({**dict(src.items()), "extra.weight": Placement((2,), torch.bfloat16, Spec.replicate(1),
                                                                   Mesh.of(fsdp=2))})
    with pytest.raises(LayoutError, match=r"no destination parameter reads: \['extra.weight'\]"):
        reshard_plan(extra, dst)
    bad = dict(src.items())
    pl = bad["model.norm.weight"]
    bad["model.norm.weight"] = Placement((65,), pl.dtype, pl.spec, pl.mesh)
    with pytest.raises(LayoutError, match=r"shape mismatch: model.norm.weight: source \[65\]"):
        reshard_plan(Layout(bad), dst)
    bad["model.norm.weight"] = Placement(pl.shape, torch.float16, pl.spec, pl.mesh)
    with pytest.raises(LayoutError, match="dtype mismatch: model.norm.weight"):
        reshard_plan(Layout(bad), rollout_layout(MODELS["qwen3-tiny"], tp=2))


@given(st.sets(st.sampled_from(["drop", "extra", "shape", "dtype"])), st.integers(0, 10_000))
def test_the_planner_refuses_what_check_compatible_refuses_with_its_message(faults, pick):
    """The planner checks each demand against its source as it walks them; whatever the mismatch (or several), it
    raises check_compatible's own error, and plans when there is none."""
    from hyperrl.sharding import check_compatible

    src = dict(trainer_layout(MODELS["qwen3-tiny"], fsdp=2).items())
    dst = rollout_layout(MODELS["qwen3-tiny"], tp=2)
    names = sorted(src)
    victim = names[pick % len(names)]
    pl = src[victim]
    if "shape" in faults:
        src[victim] = Placement((*pl.shape[:-1], pl.shape[-1] + 1), pl.dtype, pl.spec, pl.mesh)
    if "dtype" in faults:
        src[victim] = Placement(src[victim].shape, torch.float16, pl.spec, pl.mesh)
    if "drop" in faults:
        del src[names[(pick + 1) % len(names)]]
    if "extra" in faults:
        src["extra.weight"] = Placement((2,), pl.dtype, Spec.replicate(1), pl.mesh)
    src = Layout(src)
    try:
        check_compatible(src, dst)
    except LayoutError as e:
        with pytest.raises(LayoutError) as got:
            reshard_plan(src, dst)
        assert str(got.value) == str(e)
    else:
        assert not faults
        verify(reshard_plan(src, dst))


def test_verify_catches_dropped_and_duplicated_transfers():
    src, dst = _plan_for("qwen3-moe-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=1, offset=4))
    plan = reshard_plan(src, dst)
    ts = plan.transfers()

    class Fixed(Plan):
        def __init__(self, base, transfers):
            super().__init__(base.src, base.dst, [], base.fan_out)
            self._t = transfers

        def __iter__(self):
            return iter(self._t)

    victim = next(i for i, t in enumerate(ts) if "experts.5.up_proj" in t.tensor)
    with pytest.raises(PlanError, match=r"experts.5.up_proj.weight: no source|received \d+ elements"):
        verify(Fixed(plan, ts[:victim] + ts[victim + 1:]))
    with pytest.raises(PlanError, match="overlap"):
        verify(Fixed(plan, ts + [ts[victim]]))


@pytest.mark.parametrize("cap", [64, 200, 1000])
def test_buckets_respect_cap_and_cover(cap):
    src, dst = _plan_for("qwen3-tiny", dict(fsdp=4), dict(tp=2, dp=2, offset=4))
    plan = reshard_plan(src, dst, fan_out=True)
    buckets = plan.buckets(cap)
    for b in buckets:
        sent, recv = {}, {}
        for t in b:
            sent[t.src_rank] = sent.get(t.src_rank, 0) + t.nbytes
            recv[t.dst_rank] = recv.get(t.dst_rank, 0) + t.nbytes
        assert max(sent.values()) <= cap and max(recv.values()) <= cap
    flat = [t for b in buckets for t in b]
    assert sum(t.nbytes for t in flat) == sum(t.nbytes for t in plan)
    phases = [b[0].phase for b in buckets]
    assert phases == sorted(phases)  # forwards only after every source bucket

    class Fixed(Plan):
        def __iter__(self):
            return iter(flat)

    verify(Fixed(plan.src, plan.dst, [], True))
    with pytest.raises(ValueError, match="smaller than one element"):
        plan.buckets(2)


def test_traffic_matrix_sums_to_wire_bytes():
    src, dst = _plan_for("qwen3-moe-tiny", dict(fsdp=2, ep=2), dict(tp=2, dp=2, offset=2))
    for fan_out in (False, True):
        plan = reshard_plan(src, dst, fan_out=fan_out)
        senders, receivers, m = plan.traffic()
        assert int(m.sum()) == plan.stats().wire_bytes
        brute = {}
        for t in plan:
            if not t.local:
                brute[(t.src_rank, t.dst_rank)] = brute.get((t.src_rank, t.dst_rank), 0) + t.nbytes
        assert brute == {(a, b): int(m[i, j]) for i, a in enumerate(senders) for j, b in enumerate(receivers)
                         if m[i, j]}


def test_sender_choice_balances_source_replicas():
    # a norm replicated on all 4 trainer ranks, read in 8 row-shards: each replica sends 1/4 of the bytes
    src = Layout({"n": Placement((64,), torch.float32, Spec.replicate(1), Mesh.of(tp=4))})
    dst = plain_destination({"n": ((64,), torch.float32, Spec.shard(1, d0="tp"))}, Mesh.of(tp=8, offset=4))
    senders, _, m = reshard_plan(src, dst).traffic()
    per = m.sum(1)
    assert len(senders) == 4 and per.max() == per.min() == 64 * 4 // 4


@pytest.mark.parametrize("src_mesh", [Mesh.of(ep=2).submesh(ep=1), Mesh((), (3,))],
                         ids=["pure-EP expert sub-mesh", "zero-axis trainer mesh"])
@pytest.mark.parametrize("fan_out", [False, True])
def test_zero_axis_source_mesh_plans_and_delivers(src_mesh, fan_out):
    # a source tensor on a mesh with no axes (one rank) used to crash inside np.unravel_index
    assert src_mesh.names == () and src_mesh.size == 1
    src = Layout({"w": Placement((4, 6), torch.float32, Spec.replicate(2), src_mesh)})
    dst = plain_destination({"w": ((4, 6), torch.float32, Spec(((), ("tp",))))}, Mesh.of(tp=2, offset=10))
    plan = reshard_plan(src, dst, fan_out=fan_out)
    verify(plan)
    full = random_state(src)
    got, want = simulate(plan, full), expected_destination(dst, full)
    assert {t.src_rank for t in plan if t.phase == 0} == set(src_mesh.ranks)
    for rank, params in want.items():
        assert torch.equal(got[rank]["w"], params["w"]), rank


def _dst(part, mesh=None):
    from hyperrl.sharding import DstParam

    return DstLayout({"p": DstParam(torch.float32, mesh or Mesh.of(tp=2), (part,))})


def test_destination_layouts_that_would_lose_data_are_refused_naming_the_param():
    from hyperrl.sharding import ChunkRule, HeadReplicaRule, Part

    tp = ChunkRule(Spec.shard(2, d0="tp"))
    with pytest.raises(LayoutError, match=r"p \(part 0, shape \[4, 6\]; from 'w'\): rule spec .* has 3 dims, the part "
                                          r"has 2"):
        _dst(Part.plain("w", (4, 6), ChunkRule(Spec.shard(3, d0="tp"))))  # used to be accepted, a dim ignored
    with pytest.raises(LayoutError, match=r"p \(part 0, shape \[4, 6, 2\]; from 'w'\): rule spec .* has 2 dims"):
        _dst(Part.plain("w", (4, 6, 2), tp))  # used to crash inside numpy
    with pytest.raises(LayoutError, match=r"block 'e1' at \[5, 0, 0\] .* lies outside the part"):
        _dst(Part.stacked(["e0", "e1"], (4, 6), ChunkRule(Spec.shard(3, d0="tp")), order=[0, 5]))
    with pytest.raises(LayoutError, match=r"block 'w' at \[0, 0\] of size \[4, 6\] lies outside"):
        _dst(Part.plain("w", (4, 6), tp, pad_shape=(2, 6)))  # padded extent smaller than the tensor
    with pytest.raises(LayoutError, match=r"2 kv heads × 2 rows cover 4 rows of dim 0, the part has 8"):
        _dst(Part.plain("k", (8, 6), HeadReplicaRule("tp", n_heads=2, head_dim=2)))
    with pytest.raises(LayoutError, match=r"blocks 'e0' and 'e1' share the slot \[0, 0, 0\]"):
        _dst(Part.stacked(["e0", "e1"], (4, 6), ChunkRule(Spec.replicate(3)), order=[0, 0]))
    with pytest.raises(LayoutError, match=r"p \(part 0.*rule axis 'ep' is not a destination mesh axis \['tp'\]"):
        _dst(Part.plain("w", (4, 6), ChunkRule(Spec.shard(2, d0="ep"))))


def test_a_placement_that_does_not_fit_its_mesh_or_tensor_is_refused_at_construction():
    from hyperrl.sharding import SpecError

    # an axis not on the mesh: named, with the mesh's axes (was accepted until a Layout held it)
    with pytest.raises(SpecError, match=r"placement of a \[8\] tensor on mesh \['fsdp'\]: spec axis 'tp' is not a "
                                        r"mesh axis \['fsdp'\]"):
        Placement((8,), torch.float32, Spec.shard(1, d0="tp"), Mesh.of(fsdp=2))
    # a spec of another rank than the tensor: both ranks named (was accepted)
    with pytest.raises(SpecError, match=r"placement of a \[8, 4\] tensor .*: spec has 1 dims but the tensor has shape "
                                        r"\[8, 4\]"):
        Placement((8, 4), torch.float32, Spec.shard(1, d0="fsdp"), Mesh.of(fsdp=2))
    Placement((8, 4), torch.float32, Spec.shard(2, d0="fsdp"), Mesh.of(fsdp=2))  # a fitting one is accepted


def test_refused_destination_rules_name_the_parameter_and_its_sources():
    from hyperrl.sharding import ChunkRule, DstParam, HeadReplicaRule, Part

    def fused(rule):  # one destination parameter "qk" fused from the source tensors w.q and w.k
        part = Part((8, 6), (Block("w.q", (0, 0), (4, 6)), Block("w.k", (4, 0), (4, 6))), rule)
        return DstLayout({"qk": DstParam(torch.float32, Mesh.of(tp=2), (part,))})

    # a rule of smaller rank than its part
    with pytest.raises(LayoutError, match=r"qk \(part 0, shape \[8, 6\]; from 'w.q', 'w.k'\): rule spec .* has 1 "
                                          r"dims, the part has 2"):
        fused(ChunkRule(Spec.shard(1, d0="tp")))
    # kv heads covering fewer rows than the part
    with pytest.raises(LayoutError, match=r"qk \(part 0, shape \[8, 6\]; from 'w.q', 'w.k'\): 1 kv heads × 4 rows "
                                          r"cover 4 rows of dim 0, the part has 8"):
        fused(HeadReplicaRule("tp", n_heads=1, head_dim=4))
    fused(HeadReplicaRule("tp", n_heads=2, head_dim=4))  # the fitting rule is accepted


def test_fan_out_is_a_tree_that_spreads_the_forwards():
    # 2 trainer ranks → 8 rollout replicas (tp 2 × dp 8): each region leaves the source once and is
    # forwarded down a binary tree — ⌊log2 8⌋ = 3 forwarding phases for a region that 8 ranks read,
    # 4 for the kv rows every one of the 16 ranks reads (n_kv = 1 < tp: replicated)
    src, dst = _plan_for("qwen3-tiny", dict(fsdp=2), dict(tp=2, dp=8, offset=2))
    plan = reshard_plan(src, dst, fan_out=True)
    verify(plan)
    full = random_state(src, seed=3)
    got, want = simulate(plan, full), expected_destination(dst, full)
    assert all(torch.equal(got[r][n], t) for r, ps in want.items() for n, t in ps.items())
    s = plan.stats()
    assert s.egress_bytes == s.src_min_bytes and s.wire_bytes == s.recv_min_bytes
    assert {t.phase for t in plan} == {0, 1, 2, 3, 4}
    assert s.max_out <= 1.05 * s.max_out_bound, (s.max_out, s.max_out_bound)
    # no destination rank forwards more than twice what it received (a star's root forwards 7×)
    sent, got_b = {}, {}
    for t in plan:
        if not t.local:
            sent[t.src_rank] = sent.get(t.src_rank, 0) + t.nbytes
            got_b[t.dst_rank] = got_b.get(t.dst_rank, 0) + t.nbytes
    assert all(sent.get(r, 0) <= 2 * got_b[r] for r in got_b)
    # a forward scheduled in the same phase as the data it forwards arrives is refused by verify
    ts = plan.transfers()
    i = next(k for k, t in enumerate(ts) if t.phase == 2)
    early = ts[:i] + [ts[i]._replace(phase=1)] + ts[i + 1:]

    class Fixed(Plan):
        def __iter__(self):
            return iter(early)

    with pytest.raises(PlanError, match="before it received it"):
        verify(Fixed(plan.src, plan.dst, [], True))


def _tree_sent(g, t):
    """What one member under tree ``t`` sends per rank, summed from the built tree (the reference for
    ``_Group.sent``, which counts it from the tree's shape without building it)."""
    remote = ~g.is_local
    tree = g.tree_at(t)
    nb = g.geo.numel * g.itemsize
    per: dict[int, int] = {}
    for r, b in zip(tree.sender[remote].tolist(), nb[remote].tolist()):
        per[r] = per.get(r, 0) + b
    return per, int(nb[remote & tree.is_leader].sum())


@given(layouts())
def test_a_fan_out_groups_send_counts_equal_its_built_trees(lay):
    src, dst = lay
    plan = reshard_plan(src, dst, fan_out=True)
    for g in plan.groups:
        for t in range(g.rotations):
            ranks, sent, egress = g.sent(t)
            want, want_egress = _tree_sent(g, t)
            assert dict(zip(ranks.tolist(), sent.tolist())) == {r: b for r, b in want.items() if b}
            assert egress == want_egress


def test_the_chunk_rules_boxes_at_every_position_equal_the_rules_own():
    """``_rule_boxes`` computes a ChunkRule's intervals once for all positions; each box equals ``rule.box``."""
    from hyperrl.sharding.layout import ChunkRule, _rule_boxes

    mesh = Mesh.of(ranks=list(range(12)), a=2, b=3, c=2)
    for dims, shape in [((("a",), ("b", "c")), (7, 13)), ((("c", "a"), ()), (5, 4)), (((), ("b",), ("a", "c")),
                                                                                       (3, 9, 1)), (((),), (6,))]:
        rule = ChunkRule(Spec(dims))
        assert _rule_boxes(rule, shape, mesh) == tuple(rule.box(shape, mesh, c) for _, c in mesh.coords())
