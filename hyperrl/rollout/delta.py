"""Delta publication: only the elements whose bits changed since the engine's version, in the engine's dtype.

At RL learning rates most bf16 weights do not change from one step to the next (the fp32 master moves by less
than half a bf16 ulp), so a publication can carry, per tensor, the changed elements' flat indices and new
values — or the whole tensor when that is smaller (:func:`encode_delta` picks per tensor) — with a checksum of
the new tensor that the receiver verifies after applying it (:func:`apply_delta`). The transaction names the
base version the delta is against: an engine serving another version refuses it (the publisher then falls back
to a full publication); a checksum that does not match fails the transaction naming the tensor — never a
silently wrong weight. Peers: verl's ``delta_sharded``, slime's xor + zstd with a checksum per tensor.

Two encodings (``codec``, each a :class:`Codec` registered in ``DELTA_CODECS``, with ``dense`` their fallback):
``sparse`` — int32 flat indices + values (6 bytes per changed bf16 element; no codec on the receiver) — and
``xor_zstd`` — the xor of the new and old bits, compressed by zstd (the ``zstandard``
package; level 1): 2.6–4× fewer bytes than sparse at lr 1e-6 … 1e-5, at 1.5–2× its encoding time
(benchmarks/delta.py ``--codecs``). Sparse wins where the wire is as fast as memory (one machine), xor + zstd where
the wire is the bottleneck. Either falls back to the dense tensor when that is smaller. Across processes each planned
slice travels as its delta: :mod:`hyperrl.rollout.delta_direct`.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
import torch

from hyperrl.registry import Registry
from hyperrl.rollout import delta_kernels as kernels
from hyperrl.rollout.base import DeltaError

__all__ = ["TensorDelta", "encode_delta", "apply_delta", "apply_delta_", "undo_delta_", "tensor_checksum",
           "DeltaError", "to_wire", "from_wire", "tensor_to_wire", "tensor_from_wire", "CODECS", "DELTA_CODECS",
           "Codec", "codec", "codec_of", "codec_by_code"]


def _zstd():
    """The ``zstandard`` module, or a :class:`DeltaError` saying how to install it."""
    try:
        import zstandard
    except ImportError:
        raise DeltaError("delta encoding xor_zstd: the zstandard package is missing on this process — `pip install "
                         "zstandard` (hyperrl's train extra), or rollout.delta_encoding=sparse") from None
    return zstandard


def _xor_compress(new_bits: torch.Tensor, old_bits: torch.Tensor) -> torch.Tensor:
    """zstd (level 1) of ``new ^ old`` (1-D integer bits of unit stride), as a uint8 tensor."""
    z = _zstd()
    x = torch.bitwise_xor(new_bits, old_bits)
    out = z.ZstdCompressor(level=1, threads=max(torch.get_num_threads(), 1)).compress(x.view(torch.uint8).numpy())
    return torch.frombuffer(bytearray(out), dtype=torch.uint8)


def _xor_decompress(payload: torch.Tensor, bits_dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The xor bits a ``_xor_compress`` payload holds (``numel`` integers of ``bits_dtype``)."""
    raw = _zstd().ZstdDecompressor().decompress(payload.numpy().tobytes())
    x = torch.frombuffer(bytearray(raw), dtype=bits_dtype)
    if x.numel() != numel:
        raise DeltaError(f"an xor_zstd payload of {x.numel()} elements for a slice of {numel}")
    return x

# tensor_from_wire's tensors over the object store's read-only arrays are only read: torch's warning about them is
# silenced for this module's calls only (a filter, not catch_warnings: that is not thread-safe)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=r"hyperrl\.rollout\.delta")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INDEX = {4: np.int32, 8: np.int64}


class TensorDelta(NamedTuple):
    """One tensor's publication against a base: ``sparse`` — ``indices`` (int32 / int64 flat) and ``values``
    of the changed elements — or ``dense`` (``values``: the whole new tensor); ``checksum`` of the new tensor."""

    kind: str
    indices: torch.Tensor | None
    values: torch.Tensor
    numel: int
    checksum: int
    changed: int  # elements whose bits changed (a dense delta carries all ``numel``)

    def apply(self, base: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """:func:`apply_delta` of this delta to ``base``."""
        return apply_delta(base, self, name)

    @property
    def elementwise(self) -> bool:
        """Its values are the new tensor's elements — checked finite before any write — as its codec declares (an
        xor delta's are compressed bytes: known only once applied)."""
        return codec_of(self).elementwise

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (indices + values)."""
        idx = 0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        return idx + self.values.numel() * self.values.element_size()


def tensor_to_wire(t: torch.Tensor) -> tuple:
    """``t`` as ``(numpy array of its bits, dtype name, shape)``: pickle 5 (Ray's object store) carries numpy arrays
    as out-of-band buffers — one copy into the store, none out of it — where a torch tensor is pickled through
    ``torch.save`` (a copy each way). :func:`tensor_from_wire` undoes it."""
    t = t.detach().cpu()
    return _flat(_bits(t)).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def tensor_from_wire(w: tuple) -> torch.Tensor:
    """The tensor a :func:`tensor_to_wire` tuple holds, over the received array — no copy. The object store's
    arrays are read-only: the tensor is only to be read (engines copy what they stage)."""
    array, dtype, shape = w
    return torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)


def to_wire(d: TensorDelta) -> tuple:
    """``d`` with its tensors in :func:`tensor_to_wire`'s form (no copy through Ray's serializer);
    :func:`from_wire` undoes it."""
    idx = None if d.indices is None else tensor_to_wire(d.indices)
    return d.kind, idx, tensor_to_wire(d.values), d.numel, d.checksum, d.changed


def from_wire(w: tuple) -> TensorDelta:
    """The :class:`TensorDelta` a :func:`to_wire` tuple holds, its tensors over the received arrays (read-only: a
    delta's tensors are only ever read)."""
    kind, idx, values, numel, checksum, changed = w
    idx = None if idx is None else tensor_from_wire(idx)
    return TensorDelta(kind, idx, tensor_from_wire(values), numel, checksum, changed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of its width (bit equality, not float equality: −0.0 ≠ 0.0, NaN = NaN)."""
    return t.contiguous().view(_BITS[t.element_size()]) if t.is_floating_point() else t.contiguous()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D tensor of unit stride (a view when it is one already: a one-element view of a strided tensor
    keeps its stride, which byte views refuse)."""
    t = t.reshape(-1)
    return t if not t.numel() or t.stride(0) == 1 else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def tensor_checksum(t: torch.Tensor) -> int:
    """xxh3-64 of ``t``'s bytes (its dtype's bits, row-major) by 2 MiB blocks, then of the blocks' digests, as a
    signed int64 (:func:`hyperrl.rollout.delta_kernels.checksum`). xxh3 rather than zlib's Adler-32: 9 ms against
    86 ms over a 297 MiB bf16 embedding on this machine (benchmarks/delta_kernels.py) — a delta publication
    checksums every tensor twice."""
    return kernels.checksum(_flat(_bits(t.detach().cpu())).view(torch.uint8).numpy())  # the buffer itself: no copy


def _scan(new: torch.Tensor, base: torch.Tensor, index_bytes: int) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                                         int, int]:
    """Where ``new`` and ``base`` (same shape and dtype) differ bit for bit: ``(indices, values, changed,
    checksum)`` — the flat indices (``index_bytes`` wide, ascending) and new values of the changed elements, or
    None for both when they would be no smaller than the dense tensor (``changed × (index + value bytes) ≥ numel ×
    value bytes``); how many changed; :func:`tensor_checksum` of ``new``. On the CPU one threaded pass
    (:func:`hyperrl.rollout.delta_kernels.scan`), on a GPU whole-tensor ops."""
    nb, ob = _flat(_bits(new.detach())), _flat(_bits(base.detach()))
    n, item = nb.numel(), nb.element_size()
    limit = (n * item - 1) // (index_bytes + item)  # the most changed elements a sparse delta is smaller at (-1: none)
    if nb.device.type != "cpu":
        changed = torch.nonzero(nb != ob).flatten()
        k = changed.numel()
        if k > limit:
            return None, None, k, tensor_checksum(nb)
        return changed.to(_BITS[index_bytes]), nb[changed].view(new.dtype), k, tensor_checksum(nb)
    idx, values, k, check = kernels.scan(nb.numpy(), ob.numpy(), limit, _NP_INDEX[index_bytes])
    if idx is None:
        return None, None, k, check
    return torch.from_numpy(idx), torch.from_numpy(values).view(new.dtype), k, check


def _swap_(flat: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Write ``values`` at ``flat``'s indices ``idx`` in place; returns the old values there and the new
    :func:`tensor_checksum` — on the CPU in one threaded pass (:func:`hyperrl.rollout.delta_kernels.swap`) when
    the indices ascend (an encoder's always do), else by torch's indexing (which names an index out of range)."""
    if idx.dim() != 1 or values.shape != idx.shape:  # before anything is written
        raise DeltaError(f"{idx.numel()} indices and {values.numel()} values: a delta needs one value per index")
    values = values.to(device=flat.device, dtype=flat.dtype)
    if flat.device.type == "cpu" and idx.device.type == "cpu" and flat.is_contiguous():
        bits = _bits(flat)
        done = kernels.swap(bits.numpy(), idx.numpy(), _bits(values).numpy())
        if done is not None:
            return torch.from_numpy(done[0]).view(flat.dtype), done[1]
    i = idx.long().to(flat.device)
    old = flat[i].clone()
    flat[i] = values
    return old, tensor_checksum(flat)


class Codec(ABC):
    """One way a tensor's change travels, registered in ``DELTA_CODECS`` under the ``kind`` its deltas carry:
    ``dense`` (the whole new tensor), ``sparse`` (the changed elements' flat indices and new values), ``xor_zstd``
    (the xor of the new and old bits, compressed). ``encode(new, base, scan)`` → a :class:`TensorDelta` (scan:
    :func:`_scan`'s ``(indices, values, changed, checksum)``); ``slice(new, old, scan)`` → ``(code, payload)`` of a
    planned transfer (None: the dense slice); ``write_(flat, delta)`` applies one in place → ``(undo, checksum or
    None: not known without hashing)``; ``undo_(flat, undo)`` restores; ``write_slice_(flat, payload, changed)`` →
    a checksum or None. ``code``: a slice header's kind; ``elementwise``: its values are the new tensor's elements
    (checked finite before any write; a compressed payload is bytes); ``whole``: it carries the whole tensor;
    ``selectable``: a ``rollout.delta_encoding`` (dense is the fallback of both)."""

    code = 0
    elementwise = True
    whole = False
    selectable = False

    @abstractmethod
    def encode(self, new: torch.Tensor, base: torch.Tensor, scan: tuple) -> TensorDelta:
        """The delta of ``new`` against ``base`` in this codec (or the fallback it chooses)."""

    def slice(self, new: torch.Tensor, old: torch.Tensor, scan: tuple) -> tuple[int, torch.Tensor] | None:
        """A changed slice's ``(code, payload)`` (None: send it dense)."""
        return None

    @abstractmethod
    def write_(self, flat: torch.Tensor, delta: TensorDelta) -> tuple[tuple, int | None]:
        """Apply ``delta`` to ``flat`` (1-D, in place)."""

    @abstractmethod
    def undo_(self, flat: torch.Tensor, undo: tuple) -> None:
        """Restore ``flat`` from :meth:`write_`'s undo."""

    @abstractmethod
    def write_slice_(self, flat: torch.Tensor, payload: torch.Tensor, changed: int) -> int | None:
        """Write a received slice payload into ``flat`` (1-D, contiguous, in place)."""


DELTA_CODECS: Registry = Registry("delta codec")


def _sparse_or_dense(new: torch.Tensor, scan: tuple) -> TensorDelta:
    """The sparse delta, or the dense tensor where that is no bigger (the scan found too many changes)."""
    changed, values, k, check = scan
    flat = new.detach().reshape(-1)
    if changed is None:
        return TensorDelta("dense", None, flat.clone(), new.numel(), check, k)
    return TensorDelta("sparse", changed, values, new.numel(), check, k)


@DELTA_CODECS.register("dense")
class DenseCodec(Codec):
    """The whole new tensor (what either encoding falls back to where it is smaller)."""

    code, whole = 0, True

    def encode(self, new, base, scan):
        return TensorDelta("dense", None, new.detach().reshape(-1).clone(), new.numel(), scan[3], scan[2])

    def write_(self, flat, delta):
        undo = (None, flat.clone())
        flat.copy_(delta.values.to(device=flat.device, dtype=flat.dtype))
        return undo, None

    def undo_(self, flat, undo):
        flat.copy_(undo[1])

    def write_slice_(self, flat, payload, changed):
        flat.copy_(payload.view(flat.dtype))
        return None


@DELTA_CODECS.register("sparse")
class SparseCodec(Codec):
    """int32 (int64 past 2³¹ elements) flat indices + the new values of the changed elements: 6 bytes per changed
    bf16 element, no codec on the receiver; the dense tensor where that is smaller."""

    code, selectable = 1, True

    def encode(self, new, base, scan):
        return _sparse_or_dense(new, scan)

    def slice(self, new, old, scan):
        changed, values, _, _ = scan
        return None if changed is None else (1, torch.cat([changed.view(torch.uint8), values.view(torch.uint8)]))

    def write_(self, flat, delta):
        old, check = _swap_(flat, delta.indices, delta.values)
        return (delta.indices, old), check

    def undo_(self, flat, undo):
        idx, old = undo
        flat[idx.long().to(flat.device)] = old.to(flat.device)

    def write_slice_(self, flat, payload, changed):
        return _swap_(flat, payload[:4 * changed].view(torch.int32), payload[4 * changed:].view(flat.dtype))[1]


@DELTA_CODECS.register("xor_zstd", requires=(("zstandard", "pip install zstandard (hyperrl's train extra), or "
                                                           "rollout.delta_encoding=sparse"),))
class XorZstdCodec(Codec):
    """zstd (level 1) of the xor of the new and old bits: 2.6–4× fewer bytes than sparse at lr 1e-6 … 1e-5, at
    1.5–2× its encoding time (benchmarks/delta.py ``--codecs``); a float tensor only, else (or where the
    compressed xor is no smaller) sparse or dense — a slice, dense."""

    code, elementwise, selectable = 2, False, True

    def encode(self, new, base, scan):
        if new.is_floating_point():
            packed = _xor_compress(_flat(_bits(new)), _flat(_bits(base)))
            if packed.numel() < new.numel() * new.element_size():
                return TensorDelta("xor_zstd", None, packed, new.numel(), scan[3], scan[2])
        return _sparse_or_dense(new, scan)

    def slice(self, new, old, scan):
        packed = _xor_compress(_bits(new), _bits(old))
        return (2, packed) if packed.numel() < new.numel() * new.element_size() else None

    def write_(self, flat, delta):
        bits = flat.view(_BITS[flat.element_size()])
        bits.bitwise_xor_(_xor_decompress(delta.values.cpu(), bits.dtype, bits.numel()).to(bits.device))
        return (None, delta.values), None  # compressed: decompressed again only to undo

    def undo_(self, flat, undo):
        bits = flat.view(_BITS[flat.element_size()])
        bits.bitwise_xor_(_xor_decompress(undo[1].cpu(), bits.dtype, bits.numel()).to(bits.device))

    def write_slice_(self, flat, payload, changed):
        bits = _bits(_flat(flat))
        flat.copy_(torch.bitwise_xor(bits, _xor_decompress(payload, bits.dtype, bits.numel())).view(flat.dtype))
        return None


CODECS = tuple(n for n in DELTA_CODECS.in_order() if DELTA_CODECS.get(n).selectable)  # rollout.delta_encoding's


def codec(name: str) -> Codec:
    """The registered codec ``name``, ready to use (an unknown name: a ``KeyError`` listing the registered ones)."""
    return DELTA_CODECS.get(name)()


def codec_of(delta: TensorDelta) -> Codec:
    """The codec a delta was encoded in (its ``kind``)."""
    return codec(delta.kind)


def codec_by_code(code: int) -> Codec | None:
    """The codec a slice header's kind ``code`` names (None: no registered codec has it)."""
    return next((codec(n) for n in DELTA_CODECS.in_order() if DELTA_CODECS.get(n).code == code), None)


def encode_delta(new: torch.Tensor, base: torch.Tensor, codec: str = "sparse") -> TensorDelta:
    """``new`` against ``base`` (same shape and dtype: the engine's) in ``codec`` (:data:`CODECS`): the changed
    elements sparse (or, ``xor_zstd``, the xor of the bits compressed — ``values`` the compressed bytes), or the
    whole tensor when that is smaller (sparse: ``changed × (index + value bytes) ≥ numel × value bytes``)."""
    if codec not in CODECS:
        raise ValueError(f"delta codec {codec!r}; choose one of {', '.join(CODECS)}")
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"encode_delta: new {tuple(new.shape)} {new.dtype} against base {tuple(base.shape)} "
                         f"{base.dtype}; a delta needs one shape and dtype")
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    return DELTA_CODECS.get(codec)().encode(new, base, _scan(new, base, index_dtype.itemsize))


_MISMATCH = "checksum mismatch after applying the delta (the engine's base differs from the publisher's, or the " \
            "delta was damaged)"


def apply_delta(base: torch.Tensor, delta: TensorDelta, name: str = "tensor") -> torch.Tensor:
    """The new tensor: ``base`` with the delta's elements written (a copy; ``base`` is not changed), its
    checksum verified — a mismatch is a :class:`DeltaError` naming ``name``."""
    if delta.numel != base.numel():
        raise DeltaError(f"{name}: a delta of {delta.numel} elements for a tensor of {base.numel()}")
    out = base.detach().clone().reshape(-1)
    try:
        _, check = codec_of(delta).write_(out, delta)
    except DeltaError as e:
        raise DeltaError(f"{name}: {e}") from None
    out = out.reshape(base.shape)
    if (check if check is not None else tensor_checksum(out)) != delta.checksum:
        raise DeltaError(f"{name}: {_MISMATCH}")
    return out


def apply_delta_(t: torch.Tensor, delta: TensorDelta, name: str = "tensor") -> tuple:
    """:func:`apply_delta` in place: ``t`` (contiguous) becomes the new tensor, its checksum verified; returns
    the undo — what :func:`undo_delta_` needs to restore ``t`` exactly (the changed elements' old values, the
    old tensor of a dense delta, the xor of an xor one). A mismatch restores ``t`` and raises :class:`DeltaError`
    naming ``name``."""
    if delta.numel != t.numel():
        raise DeltaError(f"{name}: a delta of {delta.numel} elements for a tensor of {t.numel()}")
    flat = t.detach().view(-1)
    try:
        undo, check = codec_of(delta).write_(flat, delta)
    except DeltaError as e:
        raise DeltaError(f"{name}: {e}") from None
    undo = (delta.kind, *undo)
    if (check if check is not None else tensor_checksum(t)) != delta.checksum:
        undo_delta_(t, undo)
        raise DeltaError(f"{name}: {_MISMATCH}")
    return undo


def undo_delta_(t: torch.Tensor, undo: tuple) -> None:
    """Restore ``t`` from :func:`apply_delta_`'s undo (bit for bit)."""
    kind, *rest = undo
    codec(kind).undo_(t.detach().view(-1), tuple(rest))
