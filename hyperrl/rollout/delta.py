"""Delta publication: only the elements whose bits changed since the engine's version, in the engine's dtype.

At RL learning rates most bf16 weights do not change from one step to the next (the fp32 master moves by less
than half a bf16 ulp), so a publication can carry, per tensor, the changed elements' flat indices and new
values — or the whole tensor when that is smaller (:func:`encode_delta` picks per tensor) — with a checksum of
the new tensor that the receiver verifies after applying it (:func:`apply_delta`). The transaction names the
base version the delta is against: an engine serving another version refuses it (the publisher then falls back
to a full publication); a checksum that does not match fails the transaction naming the tensor — never a
silently wrong weight. Peers: verl's ``delta_sharded``, slime's xor + zstd with a checksum per tensor.
Sparse indices + values are used here rather than xor + a compressor: at the fractions measured
(benchmarks/publish.py) the index list is already a fraction of the dense size, and it needs no codec on the
receiver.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

import torch

from hyperrl.rollout.base import DeltaError

__all__ = ["TensorDelta", "encode_delta", "apply_delta", "tensor_checksum", "DeltaError"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    def nbytes(self) -> int:
        """Bytes on the wire (indices + values)."""
        idx = 0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        return idx + self.values.numel() * self.values.element_size()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as integers of its width (bit equality, not float equality: −0.0 ≠ 0.0, NaN = NaN)."""
    return t.contiguous().view(_BITS[t.element_size()]) if t.is_floating_point() else t.contiguous()


def tensor_checksum(t: torch.Tensor) -> int:
    """Adler-32 of ``t``'s bytes (zlib; its dtype's bits, row-major)."""
    b = _bits(t.detach().cpu()).flatten()
    return zlib.adler32(b.view(torch.uint8).numpy())  # the buffer itself: no copy


def encode_delta(new: torch.Tensor, base: torch.Tensor) -> TensorDelta:
    """``new`` against ``base`` (same shape and dtype: the engine's): the changed elements sparse, or the whole
    tensor when ``changed × (index + value bytes) ≥ numel × value bytes``."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"encode_delta: new {tuple(new.shape)} {new.dtype} against base {tuple(base.shape)} "
                         f"{base.dtype}; a delta needs one shape and dtype")
    flat, n = new.detach().reshape(-1), new.numel()
    changed = torch.nonzero(_bits(new).reshape(-1) != _bits(base).reshape(-1)).flatten()
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    item, ibytes = new.element_size(), torch.empty((), dtype=index_dtype).element_size()
    check = tensor_checksum(new)
    if changed.numel() * (ibytes + item) >= n * item:
        return TensorDelta("dense", None, flat.clone(), n, check, changed.numel())
    return TensorDelta("sparse", changed.to(index_dtype), flat[changed].clone(), n, check, changed.numel())


def apply_delta(base: torch.Tensor, delta: TensorDelta, name: str = "tensor") -> torch.Tensor:
    """The new tensor: ``base`` with the delta's elements written (a copy; ``base`` is not changed), its
    checksum verified — a mismatch is a :class:`DeltaError` naming ``name``."""
    if delta.numel != base.numel():
        raise DeltaError(f"{name}: a delta of {delta.numel} elements for a tensor of {base.numel()}")
    if delta.kind == "dense":
        out = delta.values.to(base.dtype).reshape(base.shape).clone()
    else:
        out = base.detach().clone().reshape(-1)
        out[delta.indices.long().to(out.device)] = delta.values.to(device=out.device, dtype=out.dtype)
        out = out.reshape(base.shape)
    if tensor_checksum(out) != delta.checksum:
        raise DeltaError(f"{name}: checksum mismatch after applying the delta (the engine's base differs from the "
                         "publisher's, or the delta was damaged)")
    return out
