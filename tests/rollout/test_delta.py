"""Delta publication (issue 33, item 1): only the elements whose bits changed, checksummed, against a named base
version — bit-identical to a full publication after N steps, a refused base falling back to a full publication, a
damaged delta failing the transaction with the engine still serving its version; in one process, and across real
gloo processes where each planned slice travels as its delta (FSDP2 into per-rank engines, TP × FSDP2 into the
TP engine)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.rollout.delta import DeltaError, apply_delta, encode_delta, tensor_checksum
from hyperrl.rollout.delta_direct import apply_slice, encode_slice
from tests.dist_helpers import run_gloo


def _changed_pair(n: int, frac: float, dtype, seed: int):
    """A random ``base`` of ``n`` elements and ``new``: ``base`` with about ``frac`` of them redrawn."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    new = base.clone()
    hit = torch.rand(n, generator=g) < frac
    new[hit] = torch.randn(int(hit.sum()), generator=g).to(dtype)
    return base, new


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.floats(0.0, 1.0), st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
       st.integers(0, 2**16), st.sampled_from(["sparse", "xor_zstd"]))
def test_apply_of_encode_is_the_new_tensor_bit_for_bit(n, frac, dtype, seed, codec):
    base, new = _changed_pair(n, frac, dtype, seed)
    d = encode_delta(new, base, codec)
    out = apply_delta(base, d)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       new.view(torch.int16 if dtype != torch.float32 else torch.int32))
    changed = int((new.view(torch.uint8).view(-1, new.element_size()) !=
                   base.view(torch.uint8).view(-1, new.element_size())).any(-1).sum())
    assert d.changed == changed and d.nbytes <= n * new.element_size()  # never more than the dense tensor
    if codec == "sparse":
        assert d.kind == ("dense" if changed * (4 + new.element_size()) >= n * new.element_size() else "sparse")
    else:  # the compressed xor when it is smaller than the dense tensor, else the sparse rule (tiny tensors)
        assert d.kind in ("xor_zstd", "dense", "sparse") and (d.kind != "xor_zstd" or d.nbytes < n * new.element_size())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.floats(0.0, 1.0), st.sampled_from([torch.bfloat16, torch.float32]),
       st.integers(0, 2**16), st.sampled_from(["sparse", "xor_zstd"]), st.booleans())
def test_in_place_apply_is_the_new_tensor_and_its_undo_the_old_one_bit_for_bit(n, frac, dtype, seed, codec, damage):
    """:func:`apply_delta_` makes the engine's own tensor the new one (no copy); its undo — or a checksum that
    fails on a damaged base, which undoes itself — leaves the old bits exactly."""
    from hyperrl.rollout.delta import apply_delta_, undo_delta_

    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    base, new = _changed_pair(n, frac, dtype, seed)
    d = encode_delta(new, base, codec)
    t = base.clone()
    if damage and d.kind != "dense":  # the receiver's base differs where the delta does not write
        keep = (new.view(bits) == base.view(bits)).nonzero().flatten()
        if keep.numel():
            t[keep[0]] = t[keep[0]] + 1
            before = t.clone()
            with pytest.raises(DeltaError, match="w: checksum mismatch"):
                apply_delta_(t, d, "w")
            assert torch.equal(t.view(bits), before.view(bits))  # restored: nothing half-applied
            return
    undo = apply_delta_(t, d, "w")
    assert torch.equal(t.view(bits), new.view(bits))
    undo_delta_(t, undo)
    assert torch.equal(t.view(bits), base.view(bits))


def test_an_engine_refusing_a_delta_midway_serves_its_version_bit_for_bit():
    """The transformers engine applies deltas in place: a checksum failing on the second tensor undoes the
    first, and an abort after staging undoes everything — the engine serves V exactly."""
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout.hf import TransformersEngine

    eng = TransformersEngine(tiny_qwen3(40, seed=0).to(torch.bfloat16))
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    names = [k for k, _ in eng.model.named_parameters()][:2]
    new = {k: before[k].clone() for k in names}
    for k in names:
        new[k].view(-1)[:3] += 1.0
    deltas = {k: encode_delta(new[k], before[k]) for k in names}
    deltas[names[1]] = deltas[names[1]]._replace(checksum=deltas[names[1]].checksum + 1)  # damaged
    eng.begin(1, base=0)
    with pytest.raises(DeltaError, match=f"{names[1]}: checksum mismatch"):
        eng.stage_deltas(deltas)
    assert eng.policy_version == 0 and all(torch.equal(eng.model.state_dict()[k], before[k]) for k in before)
    eng.begin(1, base=0)
    eng.stage_deltas({names[0]: encode_delta(new[names[0]], before[names[0]])})
    assert not torch.equal(eng.model.state_dict()[names[0]], before[names[0]])  # applied in place, not committed
    eng.abort()
    assert all(torch.equal(eng.model.state_dict()[k], before[k]) for k in before)
    eng.begin(1, base=0, partial=True)
    eng.stage_deltas({names[0]: encode_delta(new[names[0]], before[names[0]])})
    eng.commit()
    assert eng.policy_version == 1 and torch.equal(eng.model.state_dict()[names[0]], new[names[0]])


def test_xor_zstd_carries_a_sparse_change_in_fewer_bytes_than_indices_and_values():
    """A bf16 tensor whose low bits moved in 5 % of the elements (what lr 1e-6 does to a bf16 policy): the compressed
    xor is smaller than sparse indices + values, and rebuilds the tensor bit for bit."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(200_000, generator=g) * 0.02).to(torch.bfloat16)
    new = base.clone()
    hit = torch.rand(200_000, generator=g) < 0.05
    new[hit] = (base[hit].view(torch.int16) + 1).view(torch.bfloat16)  # one ulp
    sparse, packed = encode_delta(new, base), encode_delta(new, base, "xor_zstd")
    assert sparse.kind == "sparse" and packed.kind == "xor_zstd" and packed.nbytes < sparse.nbytes / 2
    assert torch.equal(apply_delta(base, packed).view(torch.int16), new.view(torch.int16))


def test_a_receiver_without_the_compressor_fails_closed_naming_it(monkeypatch):
    from hyperrl.rollout import delta as D

    base = torch.zeros(1000, dtype=torch.bfloat16)
    new = base.clone()
    new[::50] = 1.0
    d, s_ = encode_delta(new, base, "xor_zstd"), encode_slice(new, base, "xor_zstd")

    def missing():
        raise DeltaError("delta encoding xor_zstd: the zstandard package is missing on this process")

    monkeypatch.setattr(D, "_zstd", missing)
    with pytest.raises(DeltaError, match="w: delta encoding xor_zstd: the zstandard package is missing"):
        apply_delta(base, d, "w")
    into = base.clone()
    assert "w[0:1000]: delta encoding xor_zstd: the zstandard package is missing" in \
        apply_slice(into, s_.header, s_.payload, "w[0:1000]")


def test_bits_not_values_decide_what_changed():
    base = torch.tensor([0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan")], dtype=torch.bfloat16)  # −0.0 == 0.0 as floats, not as bits
    d = encode_delta(new, base)
    assert d.changed == 1 and torch.equal(apply_delta(base, d).view(torch.int16), new.view(torch.int16))


def test_a_damaged_delta_names_the_tensor():
    base = torch.zeros(100, dtype=torch.bfloat16)
    new = base.clone()
    new[3] = 1.0
    d = encode_delta(new, base)
    bad = d._replace(values=d.values + 1)
    with pytest.raises(DeltaError, match="layers.0.w: checksum mismatch"):
        apply_delta(base, bad, "layers.0.w")
    assert tensor_checksum(new) == d.checksum


def _trainer(tmp_path, *extra):
    from hyperrl.compose import build
    from hyperrl.config import load_config

    return build(load_config(None, [f"--run.out_dir={tmp_path}", "--task=modsum", "--rollout.prompts_per_step=4",
                                    "--rollout.n=4", "--rollout.max_new_tokens=2", "--model.dtype=bfloat16",
                                    "--run.threads=1", "--rollout.delta_publication=true", "--optim.lr=1e-5", *extra]))


def _engine_equals_a_full_publication(tr):
    served = tr.engine.model.state_dict()
    for k, p in tr.policy.named_parameters():
        full = p.detach().to(served[k].dtype)  # what a full publication casts and sends
        assert torch.equal(served[k].view(torch.int16), full.view(torch.int16)), k


@pytest.mark.parametrize("codec", ["sparse", "xor_zstd"])
def test_after_n_delta_publications_the_engine_is_bit_identical_to_a_full_publication(tmp_path, codec):
    tr = _trainer(tmp_path, f"--rollout.delta_encoding={codec}")
    fracs = []
    for _ in range(6):
        m = tr.step()
        fracs.append(m["delta_frac"])
        _engine_equals_a_full_publication(tr)
    assert fracs[0] == 1.0  # the first publication is full: no base yet
    print("delta_frac per step", fracs)
    assert all(0.0 < f < 0.2 for f in fracs[1:]), fracs  # bf16 engine, fp32 master at lr 1e-5: a fraction changes
    assert m["publish_bytes"] < m["publish_full_bytes"] / 2 and tr.engine.policy_version == 6


def test_the_asynchronous_trainer_publishes_deltas_bit_identical_to_full(tmp_path):
    """η = 1 on the thread executor: each publication (the collector paused) a delta into the engine
    the worker generates from; after every step the engine holds exactly what a full publication would."""
    from hyperrl.loop.collect_async import AsyncCollector

    tr = _trainer(tmp_path, "--async.max_staleness=1")
    assert isinstance(tr.collector, AsyncCollector)
    try:
        fracs = []
        for _ in range(4):
            fracs.append(tr.step()["delta_frac"])
            _engine_equals_a_full_publication(tr)
    finally:
        tr.close()
    assert fracs[0] == 1.0 and all(0.0 < f < 0.3 for f in fracs[1:]), fracs


def test_an_engine_at_another_version_gets_a_full_publication(tmp_path):
    tr = _trainer(tmp_path)
    tr.step()
    tr.step()
    v = tr.engine.policy_version
    with torch.no_grad():  # somebody else published to the engine: it no longer holds the publisher's base
        tr.engine.load_weights({k: t.clone() for k, t in tr.engine.model.state_dict().items()}, v + 1)
    tr.version = v + 1
    m = tr.step()
    assert "delta_fallback" in tr.publisher.publisher.last and m["delta_frac"] == 1.0
    said = tr.publisher.publisher.last["delta_fallback"]
    assert "a delta against version 2, but this engine serves version 3" in said
    _engine_equals_a_full_publication(tr)
    assert tr.step()["delta_frac"] < 0.5  # deltas again, against the full publication


def test_a_checksum_failure_fails_closed_and_the_engine_keeps_serving(tmp_path):
    from hyperrl.rollout.delta import encode_delta as enc

    tr = _trainer(tmp_path)
    tr.step()
    before = {k: v.clone() for k, v in tr.engine.model.state_dict().items()}
    eng, v = tr.engine, tr.engine.policy_version
    name = next(iter(before))
    new = before[name].clone()
    new.view(-1)[0] += 1
    d = enc(new, before[name])
    eng.begin(v + 1, base=v)
    with pytest.raises(DeltaError, match=f"{name}: checksum mismatch"):
        eng.stage_deltas({name: d._replace(checksum=d.checksum ^ 1)})
    assert eng.policy_version == v and eng._txn is None
    assert all(torch.equal(before[k], t) for k, t in eng.model.state_dict().items())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.floats(0.0, 1.0), st.booleans(), st.integers(0, 2**16),
       st.sampled_from(["sparse", "xor_zstd"]))
def test_a_slice_delta_rebuilds_the_new_slice_in_place(n, frac, strided, seed, codec):
    """encode_slice → header + payload → apply_slice into a (possibly strided) view of the base: the view holds
    the new values bit for bit and the checksum verifies; the payload is never larger than the dense slice."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 3, generator=g).to(torch.bfloat16)
    new = base.clone()
    hit = torch.rand(n, 3, generator=g) < frac
    new[hit] += 1.0
    into = base.clone()
    view, want = (into[:, 1], new[:, 1]) if strided else (into, new)
    d = encode_slice(want, view.clone(), codec)
    assert d.payload.numel() <= want.numel() * 2 and d.changed == int((want != view).sum())
    assert apply_slice(view, d.header, d.payload, "w") is None
    assert torch.equal(view.view(torch.int16), want.view(torch.int16))
    damaged = d.header.clone()
    damaged[2] ^= 1
    assert "w: checksum mismatch" in apply_slice(view, damaged, d.payload, "w")
    unknown = d.header.clone()
    unknown[0] = 7  # a kind no codec has: named, nothing written
    assert "w: a slice header of delta kind 7" in apply_slice(view, unknown, d.payload, "w")


def _dist_worker(rank, world, out_dir, extra, faults, codec="sparse"):
    from hyperrl.compose import build
    from hyperrl.config import load_config
    from hyperrl.sharding.simulate import expected_destination

    tr = build(load_config(None, [f"--run.out_dir={out_dir}", "--task=modsum", "--rollout.prompts_per_step=4",
                                  "--rollout.n=4", "--rollout.max_new_tokens=2", "--model.dtype=bfloat16",
                                  "--run.threads=1", "--rollout.delta_publication=true", "--optim.lr=3e-6",
                                  f"--rollout.delta_encoding={codec}", *extra]))
    pub, out = tr.publisher.publisher, []
    name = "model.layers.0.mlp.down_proj.weight"
    for step in range(1, 7):
        if faults and step == 3 and rank == 0:  # rank 0's copy of its last pieces is damaged in rank 1's half, at
            half = pub._base.pieces[name][64:]  # its largest weight (the widest bf16 ulp: the step does not change it)
            half.view(-1)[half.abs().argmax()] += 1
        if faults and step == 5 and rank == 1:  # rank 1 believes its last publication was another version
            pub._base = dataclasses.replace(pub._base, version=pub._base.version - 1)
        m = tr.step()
        full = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(torch.bfloat16)
                for k, p in tr.policy.named_parameters()}
        if hasattr(tr.engine, "_splits"):  # the TP engine: its shards, re-fused from its local modules
            want = expected_destination(tr.engine.layout(world), full, ranks=[rank])[rank]
            got = {n: torch.cat([p.detach() for p, _ in t], d) for n, (d, t) in tr.engine._splits.items()}
        else:
            want, got = full, tr.engine.model.state_dict()
        exact = all(torch.equal(got[k].view(torch.int16), v.view(torch.int16)) for k, v in want.items())
        out.append({"frac": m["delta_frac"], "bytes": m["publish_bytes"], "full": m["publish_full_bytes"],
                    "exact": exact, "fallback": pub.last.get("delta_fallback"), "version": tr.engine.policy_version})
    tr.close()
    return out


@pytest.mark.parametrize("codec", ["sparse", "xor_zstd"])
def test_across_processes_each_slice_travels_as_its_delta_and_faults_fall_back_to_full(tmp_path, codec):
    """2 gloo processes, FSDP2 into one engine per rank (each rank receives the other's shards): after every step
    both engines equal a full publication bit for bit; delta steps put a fraction of the full direct plan's bytes
    on the wire. A damaged base on the receiver (its checksum fails on rank 0) and a base-version disagreement
    (rank 1) each fall back to a full publication on every rank, named; deltas resume the step after."""
    res = run_gloo(_dist_worker, 2, str(tmp_path), [], True, codec, timeout=600)
    for r in (0, 1):
        steps = res[r]
        assert all(s["exact"] for s in steps) and [s["version"] for s in steps] == [1, 2, 3, 4, 5, 6]
        assert steps[0]["frac"] == 1.0 and steps[0]["fallback"] is None  # no base yet: full
        for i in (1, 3, 5):  # deltas
            assert 0 < steps[i]["frac"] < 0.3 and steps[i]["bytes"] < steps[i]["full"] / 2, steps[i]
        assert steps[2]["frac"] == 1.0 and "checksum mismatch" in steps[2]["fallback"]
        assert "rank 0: model.layers.0.mlp.down_proj.weight" in steps[2]["fallback"]
        assert steps[4]["frac"] == 1.0 and "rank 1: a delta against version 3, but this engine serves version 4" \
            in steps[4]["fallback"]
    assert [s["bytes"] for s in res[0]] == [s["bytes"] for s in res[1]]  # totals over the ranks, the same on each


def test_delta_publication_into_the_tp_engine_under_tp_x_fsdp(tmp_path):
    """4 gloo processes, run.tp=2 (dp 2 × tp 2) into the TP engine (vLLM's fused layout): each rank's served
    shards equal a full publication's after every step; deltas carry a fraction of the bytes."""
    res = run_gloo(_dist_worker, 4, str(tmp_path), ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}",
                                                    "--model.hidden=64", "--model.intermediate=128"], False,
                   timeout=600)
    for r in range(4):
        assert all(s["exact"] for s in res[r]) and res[r][0]["frac"] == 1.0
        assert all(0 < s["frac"] < 0.3 and s["bytes"] < s["full"] / 2 for s in res[r][1:]), res[r]


def test_delta_publication_is_refused_where_it_does_not_run_yet():
    from hyperrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout.delta_publication with an engine sharing the trainer's weights"):
        load_config(None, ["--rollout.delta_publication=true", "--rollout.engine={name: transformers, "
                                                               "share_weights: true}"])


def test_the_codecs_are_registered_objects_and_the_configs_choices():
    """Every delta kind is a :class:`Codec` in ``DELTA_CODECS`` (distinct slice codes; what the engines and the
    publisher ask of a delta — finite-checkable values, the whole tensor — is its declaration), and the selectable
    ones are exactly ``rollout.delta_encoding``'s choices."""
    from typing import get_args

    from hyperrl.config.schema import RolloutConfig
    from hyperrl.rollout.delta import CODECS, DELTA_CODECS, codec_of

    assert DELTA_CODECS.in_order() == ["dense", "sparse", "xor_zstd"]
    assert sorted(DELTA_CODECS.get(n).code for n in DELTA_CODECS.in_order()) == [0, 1, 2]
    assert get_args(RolloutConfig.model_fields["delta_encoding"].annotation) == CODECS == ("sparse", "xor_zstd")
    base = torch.zeros(4000, dtype=torch.bfloat16)
    new = base.clone()
    new[::400] = 1.0
    kinds = {}
    for codec, changed in (("sparse", new), ("xor_zstd", new), ("sparse", torch.ones_like(base))):
        d = encode_delta(changed, base, codec)
        kinds[d.kind] = (codec_of(d).elementwise, codec_of(d).whole)
        assert torch.equal(apply_delta(base, d).view(torch.int16), changed.view(torch.int16))
    assert kinds == {"sparse": (True, False), "xor_zstd": (False, False), "dense": (True, True)}
