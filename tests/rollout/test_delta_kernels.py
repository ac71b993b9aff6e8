"""The delta publication's CPU kernels (hyperrl.rollout.delta_kernels) against torch's whole-tensor ops: the scan
finds exactly the changed elements, the swap writes exactly them and returns the old ones, the checksum is fixed by
its definition (whatever the thread count) and changes with any bit; run with tiny blocks so that every tensor
spans many steps and both threads."""

import pickle
import struct

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl.rollout import delta_kernels as kernels
from hyperrl.rollout.delta import encode_delta, from_wire, to_wire


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _pair(n: int, frac: float, dtype, seed: int):
    g = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    base = g.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    new = base.copy()
    hit = g.random(n) < frac
    new[hit] = g.integers(info.min, info.max, int(hit.sum()), dtype=dtype, endpoint=True)
    return base, new


def test_the_checksum_is_xxh3_of_the_blocks_xxh3_digests(monkeypatch):
    # the definition, by hand: blocks of BLOCK bytes, each hashed, the little-endian uint64 digests hashed again
    monkeypatch.setattr(kernels, "BLOCK", 8)
    a = np.arange(20, dtype=np.uint8)  # blocks [0:8], [8:16], [16:20]
    parts = [xxhash.xxh3_64_intdigest(a[s:s + 8].tobytes()) for s in (0, 8, 16)]
    assert kernels.checksum(a) == _signed(xxhash.xxh3_64_intdigest(struct.pack("<3Q", *parts)))
    assert kernels.checksum(a[:0]) == _signed(xxhash.xxh3_64_intdigest(b""))  # no blocks: the digest of nothing


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 300), st.floats(0.0, 1.0), st.sampled_from([np.int16, np.int32, np.uint8]),
       st.integers(0, 2**16), st.sampled_from([8, 24, 64, 2 << 20]))
def test_scan_finds_exactly_the_changed_elements(n, frac, dtype, seed, block):
    base, new = _pair(n, frac, dtype, seed)
    kernels.BLOCK, before, threads = block, kernels.BLOCK, torch.get_num_threads()
    try:
        sums = set()
        for t in (1, 2):
            torch.set_num_threads(t)
            idx, values, k, check = kernels.scan(new, base, index_dtype=np.int32)
            want = np.flatnonzero(new != base)
            assert idx.dtype == np.int32 and np.array_equal(idx, want) and np.array_equal(values, new[want])
            assert k == want.size and check == kernels.checksum(new.view(np.uint8))  # the tensor's checksum
            sums.add(check)
            for limit in (want.size, want.size - 1, 0):  # past the limit only the count and the checksum
                i, v, k2, c2 = kernels.scan(new, base, limit)
                assert k2 == want.size and c2 == check
                assert (i is None and v is None) == (want.size > limit)
        assert len(sums) == 1  # one checksum whatever the thread count
    finally:
        kernels.BLOCK = before
        torch.set_num_threads(threads)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.floats(0.0, 1.0), st.integers(0, 2**16), st.sampled_from([8, 24, 64, 2 << 20]))
def test_swap_writes_exactly_the_delta_and_returns_what_it_overwrote(n, frac, seed, block):
    base, new = _pair(n, frac, np.int16, seed)
    want = np.flatnonzero(new != base)
    kernels.BLOCK, before = block, kernels.BLOCK
    try:
        flat = base.copy()
        old, check = kernels.swap(flat, want.astype(np.int32), new[want])
        assert check == kernels.checksum(new.view(np.uint8))  # at the same block size
    finally:
        kernels.BLOCK = before
    assert np.array_equal(flat, new) and np.array_equal(old, base[want])


@pytest.mark.parametrize("bad", [[3, 1], [1, 1], [-1, 2], [2, 10]], ids=["descending", "repeated", "negative", "past"])
@pytest.mark.parametrize("index", [np.int32, np.int64])
def test_swap_declines_indices_it_cannot_write_in_one_pass_and_writes_nothing(bad, index, monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK", 4)
    flat = np.arange(10, dtype=np.int16)
    assert kernels.swap(flat, np.array(bad, dtype=index), np.array([7, 7], dtype=np.int16)) is None
    assert np.array_equal(flat, np.arange(10, dtype=np.int16))


@pytest.mark.parametrize("values", [np.array([7], dtype=np.int16), np.array([7, 7, 7], dtype=np.int16),
                                    np.array([7, 7], dtype=np.int32)], ids=["too-few", "too-many", "dtype"])
def test_swap_refuses_values_that_do_not_match_the_indices_before_writing(values, monkeypatch):
    """A malformed delta (say a damaged slice header's count) is refused whole — no step has written anything
    (threads would otherwise have written the steps before the one that failed)."""
    from hyperrl.rollout.delta import DeltaError

    monkeypatch.setattr(kernels, "BLOCK", 4)
    flat = np.arange(10, dtype=np.int16)
    with pytest.raises(DeltaError, match="indices and .* values"):
        kernels.swap(flat, np.array([1, 8], dtype=np.int32), values)
    assert np.array_equal(flat, np.arange(10, dtype=np.int16))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 200), st.integers(0, 2**16), st.integers(0, 7))
def test_any_flipped_bit_changes_the_checksum(n, seed, bit):
    a = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    b = a.copy()
    b[seed % n] ^= np.uint8(1 << bit)
    kernels.BLOCK, before = 16, kernels.BLOCK
    try:
        assert kernels.checksum(a) != kernels.checksum(b)
    finally:
        kernels.BLOCK = before


def test_the_encode_and_apply_run_the_kernels_over_many_steps_and_threads(threads, monkeypatch):
    """A bf16 tensor over many 64-byte steps: encode, in-place apply, undo — exact — and the checksum agrees with
    the one-pass kernels'."""
    from hyperrl.rollout.delta import apply_delta_, tensor_checksum, undo_delta_

    monkeypatch.setattr(kernels, "BLOCK", 64)
    g = torch.Generator().manual_seed(threads)
    base = torch.randn(5000, generator=g).to(torch.bfloat16)
    new = base.clone()
    hit = torch.rand(5000, generator=g) < 0.05
    new[hit] = torch.randn(int(hit.sum()), generator=g).to(torch.bfloat16)
    d = encode_delta(new, base)
    assert d.kind == "sparse" and d.changed == int((new.view(torch.int16) != base.view(torch.int16)).sum())
    t = base.clone()
    undo = apply_delta_(t, d)
    assert torch.equal(t.view(torch.int16), new.view(torch.int16)) and tensor_checksum(t) == d.checksum
    undo_delta_(t, undo)
    assert torch.equal(t.view(torch.int16), base.view(torch.int16))


def test_a_delta_on_the_wire_is_numpy_arrays_carried_out_of_band():
    """:func:`to_wire` hands pickle 5 (Ray's object store) its indices and values as out-of-band buffers — no
    copy into the serializer — and :func:`from_wire` rebuilds the delta over them."""
    base = torch.randn(1000).to(torch.bfloat16)
    new = base.clone()
    new[::7] = -new[::7]
    d = encode_delta(new, base)
    bufs = []
    blob = pickle.dumps(to_wire(d), protocol=5, buffer_callback=bufs.append)
    assert len(bufs) == 2 and len(blob) < 300  # indices and values out of band; the rest is a small header
    back = from_wire(pickle.loads(blob, buffers=bufs))
    assert back.kind == d.kind and back.checksum == d.checksum and back.changed == d.changed
    assert torch.equal(back.indices, d.indices)
    assert torch.equal(back.values.view(torch.int16), d.values.view(torch.int16))
    assert back.values.dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["empty", "bool", "strided", "int64-indices"])
def test_encode_and_in_place_apply_of_odd_tensors(case, monkeypatch):
    """0-element, bool and non-contiguous tensors, and a delta whose indices are int64, through encode →
    apply_delta_ → undo: exact, never a partial write."""
    from hyperrl.rollout.delta import TensorDelta, apply_delta, apply_delta_, undo_delta_

    monkeypatch.setattr(kernels, "BLOCK", 8)
    g = torch.Generator().manual_seed(0)
    if case == "empty":
        base = torch.empty(0, dtype=torch.bfloat16)
        new = base.clone()
    elif case == "bool":
        base = torch.rand(300, generator=g) < 0.5
        new = base.clone()
        new[::17] = ~new[::17]
    else:
        base = torch.randn(40, 30, generator=g).to(torch.bfloat16)
        new = base.clone()
        new[::9, ::4] += 1
        if case == "strided":
            base, new = base.t(), new.t()  # non-contiguous views
    d = encode_delta(new, base)
    if case == "int64-indices":
        d = TensorDelta(d.kind, d.indices.long(), d.values, d.numel, d.checksum, d.changed)
    assert torch.equal(apply_delta(base, d), new)
    t = base.contiguous().clone()
    undo = apply_delta_(t, d)
    assert torch.equal(t, new.contiguous())
    undo_delta_(t, undo)
    assert torch.equal(t, base.contiguous())


def test_a_delta_whose_values_do_not_match_its_indices_leaves_the_tensor_as_it_was():
    from hyperrl.rollout.delta import DeltaError, TensorDelta, apply_delta_

    base = torch.randn(1000).to(torch.bfloat16)
    new = base.clone()
    new[::10] += 1
    d = encode_delta(new, base)
    bad = TensorDelta(d.kind, d.indices, d.values[:-1], d.numel, d.checksum, d.changed)
    t = base.clone()
    with pytest.raises(DeltaError, match="one value per index"):
        apply_delta_(t, bad, "w")
    assert torch.equal(t.view(torch.int16), base.view(torch.int16))
