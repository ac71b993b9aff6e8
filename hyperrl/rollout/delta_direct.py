"""Delta publication across processes: each transfer of the direct reshard plan carries its slice's delta.

A sender encodes each of its planned slices against the same slice of the last publication
(:func:`encode_slice`: a 4-number header — kind, changed elements, checksum, payload bytes — then one byte payload in
the codec of :mod:`hyperrl.rollout.delta`); a receiver writes it into its copy of the last publication and verifies
the slice's checksum (:func:`apply_slice`); :func:`execute_direct_delta` runs the plan's buckets with both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperrl.rollout.delta import (
    DELTA_CODECS,
    DeltaError,
    DenseCodec,
    SparseCodec,
    _flat,
    _scan,
    codec_by_code,
    tensor_checksum,
)

__all__ = ["SliceDelta", "encode_slice", "payload_bytes", "apply_slice", "execute_direct_delta"]


class SliceDelta(NamedTuple):
    """One planned transfer's delta on the wire: ``header = [kind, changed, checksum, payload bytes]`` (int64;
    kind 0 dense, 1 sparse, 2 xor_zstd) sent first, then ``payload`` — the slice's values (dense), the changed
    elements' int32 flat indices then their values (sparse), or the compressed xor of the bits — one byte buffer."""

    header: torch.Tensor
    payload: torch.Tensor
    changed: int
    numel: int


def encode_slice(new: torch.Tensor, old: torch.Tensor, codec: str = "sparse") -> SliceDelta:
    """The delta of one transfer's slice ``new`` against what was sent the last time (``old``, same shape and
    dtype) in ``codec`` (:data:`CODECS`), or the whole slice when that is smaller; the checksum of ``new``."""
    new, old = _flat(new.contiguous()), _flat(old.contiguous())
    scan = _scan(new, old, 4)
    k, check = scan[2], scan[3]
    if not k:  # nothing changed: an empty sparse slice
        code, payload = SparseCodec.code, torch.empty(0, dtype=torch.uint8)
    else:
        code, payload = DELTA_CODECS.get(codec)().slice(new, old, scan) or (DenseCodec.code, new.view(torch.uint8))
    return SliceDelta(torch.tensor([code, k, check, payload.numel()], dtype=torch.int64), payload, k, new.numel())


def payload_bytes(header: torch.Tensor) -> int:
    """The payload length a ``header`` announces."""
    return int(header[3])


def apply_slice(target: torch.Tensor, header: torch.Tensor, payload: torch.Tensor, where: str) -> str | None:
    """Write a received slice delta into ``target`` (a view of the receiver's copy of its last publication,
    the base) in place and verify the checksum; returns the failure (naming ``where``), or None."""
    code, k, check, _ = (int(v) for v in header)
    kind = codec_by_code(code)
    if kind is None:
        return f"{where}: a slice header of delta kind {code}, which no registered codec has (a damaged header)"
    contiguous = target.is_contiguous()
    flat = target.view(-1) if contiguous else target.contiguous().view(-1)  # a copy only when strided
    try:
        got = kind.write_slice_(flat, payload, k)
    except DeltaError as e:
        return f"{where}: {e}"
    if not contiguous:
        target.copy_(flat.view(target.shape))
    if (got if got is not None else tensor_checksum(flat)) != check:
        return f"{where}: checksum mismatch after applying the delta (the receiver's base differs from the sender's, " \
               f"or the delta was damaged)"
    return None


def execute_direct_delta(plan, rank: int, src: dict, src_base: dict, dst: dict, dst_base: dict, *,
                         max_bytes: int = 128 << 20, group=None, codec: str = "sparse") -> dict:
    """The direct plan with each transfer's *delta* on the wire (the same buckets and peers as
    :func:`hyperrl.sharding.execute.execute_direct`): per bucket, every sender encodes each of its slices against
    the same slice of the last publication (``src_base``: its shards then; a fan-out forward, phase ≥ 1, against
    ``dst_base``: the receiver-side pieces then) in ``codec`` and sends a 4-number header, then the payload whose
    length the header announced; every receiver writes it into ``dst`` — a copy of its last publication's pieces — and
    verifies the slice's checksum. Local transfers copy the new values. A failure is recorded, never raised
    mid-way (the peers' collectives must still match); returns counters and ``errors``."""
    import torch.distributed as dist

    errors, sent = [], {"bytes": 0, "full": 0, "changed": 0, "numel": 0}
    for bucket in plan.buckets(max_bytes):
        heads, ops, todo = [], [], []
        for t in bucket:
            new_from = src[t.tensor] if t.phase == 0 else dst[t.param]
            if t.local and t.src_rank == rank and t.dst_rank == rank:
                dst[t.param][t.dst_slice.slices()].copy_(new_from[t.src_slice.slices()])
                continue
            if t.src_rank == rank:
                old_from = src_base[t.tensor] if t.phase == 0 else dst_base[t.param]
                d = encode_slice(new_from[t.src_slice.slices()], old_from[t.src_slice.slices()], codec)
                heads.append(dist.P2POp(dist.isend, d.header, t.dst_rank, group=group))
                ops.append(("send", t, d))
                sent["bytes"] += d.payload.numel() + d.header.numel() * 8
                sent["full"] += t.nbytes
                sent["changed"] += d.changed
                sent["numel"] += d.numel
            if t.dst_rank == rank:
                h = torch.empty(4, dtype=torch.int64)
                heads.append(dist.P2POp(dist.irecv, h, t.src_rank, group=group))
                todo.append((t, h))
        if heads:
            for req in dist.batch_isend_irecv(heads):
                req.wait()
        payloads, recv = [], []
        for _, t, d in ops:
            if d.payload.numel():  # nothing changed: the header said so, no payload
                payloads.append(dist.P2POp(dist.isend, d.payload, t.dst_rank, group=group))
        for t, h in todo:
            target = dst[t.param][t.dst_slice.slices()]
            buf = torch.empty(payload_bytes(h), dtype=torch.uint8)
            if buf.numel():
                payloads.append(dist.P2POp(dist.irecv, buf, t.src_rank, group=group))
            recv.append((t, h, buf, target))
        if payloads:
            for req in dist.batch_isend_irecv(payloads):
                req.wait()
        for t, h, buf, target in recv:
            where = f"{t.param}{t.dst_slice} from rank {t.src_rank}"
            try:
                err = apply_slice(target, h, buf, where)
            except Exception as e:  # noqa: BLE001 - a malformed payload is recorded: the later buckets must still run
                err = f"{where}: the delta does not apply ({e!r})"
            if err is not None:
                errors.append(err)
    return {**sent, "errors": errors}
