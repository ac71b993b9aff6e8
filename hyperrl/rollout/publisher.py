"""The publisher: plans from a trainer's layout into an engine's own layout and executes the plan.

``Publisher(src_layout, engine.layout(replicas), executor, engine=engine, rank=rank)`` checks the
two layouts at construction (names, shapes, dtypes — a floating-point source is cast to the
destination's dtype *before* it is sent, so the wire carries the engine's bytes) and plans once.
``publish(model, version)`` runs one engine transaction: ``begin(version)``, the executor's
pieces for this rank (by engine parameter name, each the rank's local destination shard) into
``stage``, ``commit()``; an executor failing mid-way aborts the transaction, so version ``V``
keeps serving. :meth:`Publisher.for_engine` builds the source layout from a model's parameters
(FSDP2 DTensor placements → specs on an ``fsdp`` mesh of ``world`` ranks; plain tensors
replicated) and picks the executor.

Executors ``(plan, rank, shards) -> {param: local tensor}``:

* :class:`IdentityExecutor` — one process, the identity plan: whole-tensor views, no copy (the
  engine's commit copies — or, sharing the weights, copies nothing);
* :class:`LocalExecutor` — one process into an engine that fuses or pads (vLLM's parameters):
  each slice copied into place;
* :class:`DirectExecutor` — :func:`~.execute.execute_direct` on ``torch.distributed``: exactly the
  planned slices, bucketed;
* :class:`FullGatherExecutor` — the baseline: full tensors gathered and sent whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperrl.rollout.base import WeightPublishError
from hyperrl.sharding.dtensor import dtensor_spec, is_dtensor, local
from hyperrl.sharding.layout import DstLayout, Layout, LayoutError, Placement
from hyperrl.sharding.mesh import Mesh
from hyperrl.sharding.plan import Plan, reshard_plan
from hyperrl.sharding.spec import Spec

__all__ = ["Publisher", "WeightPublishError", "source_layout", "cast_to_destination", "IdentityExecutor",
           "LocalExecutor", "DirectExecutor", "FullGatherExecutor", "DeltaBase"]


@dataclass(frozen=True)
class DeltaBase:
    """What the next delta publication is against — the last publication the engine committed: its ``version``,
    the ``pieces`` sent (in the engine's layout and dtype: what a one-process delta encodes against, and what a
    receiving rank of the direct plan applies slices to) and, across processes, this rank's source ``shards`` then
    (what a sending rank encodes its slices against)."""

    version: int
    pieces: dict
    shards: dict | None = None


def source_layout(model: torch.nn.Module, world: int) -> Layout:
    """Each parameter's global shape, dtype and spec. A DTensor keeps its *root* device mesh
    (FSDP2's ``fsdp`` axis, or a ``dp × tp`` mesh of FSDP2 over tensor parallelism, strided
    placements included: :func:`~.dtensor.dtensor_spec`) — axis names, sizes and the physical
    ranks; a plain tensor is replicated on ``Mesh.of(fsdp=world)``."""
    plain, meshes, out = Mesh.of(fsdp=world), {}, {}
    for k, p in model.named_parameters():
        if is_dtensor(p):
            mesh, spec = dtensor_spec(p, meshes)
            out[k] = Placement(tuple(p.shape), p.dtype, spec, mesh)
        else:
            out[k] = Placement(tuple(p.shape), p.dtype, Spec.replicate(p.dim()), plain)
    return Layout(out)


def cast_to_destination(src: Layout, dst: DstLayout) -> Layout:
    """``src`` with each floating tensor's dtype replaced by the dtype of the destination
    parameter reading it (publication casts at the source); other dtype differences stay and
    fail the compatibility check."""
    want = {b.src: p.dtype for _, p, _, _, b in dst.blocks()}
    out = {}
    for k, pl in src.items():
        d = want.get(k, pl.dtype)
        out[k] = replace(pl, dtype=d) if d != pl.dtype and pl.dtype.is_floating_point and d.is_floating_point else pl
    return Layout(out)


class IdentityExecutor:
    """One process: each transfer of the identity plan is a whole tensor — pass views, copy nothing."""

    def __call__(self, plan: Plan, rank: int, shards: dict[str, torch.Tensor], into=None) -> dict[str, torch.Tensor]:
        out = {}  # views: the engine's staging copies them (``into`` is not needed)
        for t in plan:
            view = shards[t.tensor][t.src_slice.slices()]
            if tuple(view.shape) != tuple(shards[t.tensor].shape) or t.param in out:
                raise LayoutError(f"{t.param}: the identity executor moves whole tensors one to one, got {t.src_slice} "
                                  f"of {t.tensor} (use DirectExecutor)")
            out[t.param] = view
        return out


def _buffers(plan: Plan, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's local destination parameters to fill (zeros where padding is never sent)."""
    out = {}
    for name, p in plan.dst.params.items():
        if rank in p.mesh.ranks:
            new = torch.zeros if p.padded else torch.empty
            out[name] = new(p.local_shape(p.mesh.ranks.index(rank)), dtype=p.dtype, device=device)
    return out


@dataclass(frozen=True)
class _IntoBuffers:
    """An executor filling freshly allocated local destination parameters; ``_execute`` moves the data."""

    max_bytes: int = 128 << 20

    def __call__(self, plan: Plan, rank: int, shards: dict[str, torch.Tensor], into=None) -> dict[str, torch.Tensor]:
        """``into``: the engine's own staging memory (``engine.buffers()``, zeros where padded) to
        fill in place — the pieces then need no second copy; else fresh buffers."""
        out = into if into is not None else _buffers(plan, rank, _device(shards))
        self._execute(plan, rank, shards, out)
        return out


class LocalExecutor(_IntoBuffers):
    """One process, a destination that fuses or pads (an engine holding vLLM's ``qkv_proj``): every
    transfer is a local copy of a slice into the engine's parameter."""

    def _execute(self, plan, rank, shards, out) -> None:
        for t in plan:
            if not t.local:
                raise LayoutError(f"{t.param}: a transfer from rank {t.src_rank} to {t.dst_rank} in a one-process plan")
            dst = out[t.param][t.dst_slice.slices()]
            dst.copy_(shards[t.tensor][t.src_slice.slices()].reshape(dst.shape))


def _one_to_one(plan: Plan) -> bool:
    """Every destination parameter is one source tensor, whole (the identity executor's case)."""
    seen = set()
    for t in plan:
        if t.param in seen or t.src_slice.sizes != plan.src[t.tensor].shape or \
                tuple(plan.dst.params[t.param].local_shape(0)) != t.dst_slice.sizes:
            return False
        seen.add(t.param)
    return True


class DirectExecutor(_IntoBuffers):
    """Exactly the planned slices, point to point, at most ``max_bytes`` staged per rank per bucket."""

    def _execute(self, plan, rank, shards, out) -> None:
        from hyperrl.sharding.execute import execute_direct

        execute_direct(plan, rank, shards, out, max_bytes=self.max_bytes)


class FullGatherExecutor(_IntoBuffers):
    """The baseline: each full tensor gathered on one rank and sent whole to every reader."""

    def _execute(self, plan, rank, shards, out) -> None:
        from hyperrl.sharding.execute import execute_full_gather

        execute_full_gather(plan.src, plan.dst, rank, shards, out, max_bytes=self.max_bytes)


def _device(shards: dict[str, torch.Tensor]) -> torch.device:
    return next(iter(shards.values())).device if shards else torch.device("cpu")


class Publisher:
    """Publishes a trainer's weights into an engine's own layout: the reshard plan from the source ``Layout`` (read
    from the model's DTensor placements) into the destination ``DstLayout`` (``engine.layout(world)``), run
    by ``executor`` (identity views in one process, direct-reshard across processes) inside the engine's
    ``begin → stage → commit`` transaction. ``parallel``: the run's parallel strategy
    (:mod:`hyperrl.distributed.strategy`) — the ranks agree through it on a delta publication across processes
    (``min_over_ranks``, ``sum_over_ranks``, ``gather_objects``)."""

    def __init__(self, src: Layout, dst: DstLayout, executor=None, *, engine=None, rank: int = 0,
                 fan_out: bool = False, parallel=None):
        self.src, self.dst = cast_to_destination(src, dst), dst
        self.engine, self.rank, self.parallel = engine, rank, parallel
        self.last: dict = {}  # what the last publication sent (see publish)
        self._base: DeltaBase | None = None  # delta publication: the last publication, when the engine holds it
        self.plan = reshard_plan(self.src, dst, fan_out=fan_out)  # checks compatibility, names listed
        if executor is None and len(self.src.ranks() | dst.ranks()) == 1:
            executor = IdentityExecutor() if _one_to_one(self.plan) else LocalExecutor()
        self.executor = executor or DirectExecutor()

    @classmethod
    def for_engine(cls, model: torch.nn.Module, engine, *, rank: int = 0, world: int = 1, executor=None,
                   parallel=None, fan_out: bool = False):
        """Plan from ``model``'s parameters into ``engine.layout(world)`` (one engine replica per rank; ``fan_out``:
        the planner's fan-out tree across replicas)."""
        return cls(source_layout(model, world), engine.layout(world), executor, engine=engine, rank=rank,
                   parallel=parallel, fan_out=fan_out)

    def shards(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's local source shards, cast to what the destination reads."""
        return {k: local(p).detach().to(self.src[k].dtype) for k, p in model.named_parameters() if k in self.src}

    def gather(self, model: torch.nn.Module, *, buffers: bool = True) -> dict[str, torch.Tensor]:
        """This rank's destination pieces, by engine parameter name (``buffers``: into an in-place engine's own
        slots when it has them)."""
        into = self.engine.buffers() if buffers and self.engine is not None and self.engine.capabilities.buffers \
            else None
        extra = {} if into is None else {"into": into}  # executors ``(plan, rank, shards)`` stay valid
        return self.executor(self.plan, self.rank, self.shards(model), **extra)

    def publish(self, model: torch.nn.Module, version: int, *, delta: bool | str = False) -> None:
        """Publish ``model`` as ``version`` through the engine's transaction (all-or-nothing: a
        refused or failed publication raises ``WeightPublishError`` and the engine keeps serving
        its version). ``delta``: carry only the elements whose bits changed since the last publication
        (:mod:`hyperrl.rollout.delta`), naming that publication's version as the base — an engine serving
        another version refuses it (as does a checksum that does not verify) and the full weights follow in a
        fresh transaction. Across processes each planned slice travels as its delta
        (:meth:`_publish_direct_delta`). ``delta`` names the encoding (``"sparse"`` — also ``True`` — or
        ``"xor_zstd"``: :data:`hyperrl.rollout.delta.CODECS`). ``last`` reports what was sent."""
        self.last = {}
        self._codec = "sparse" if delta is True else (delta or "sparse")
        if delta and len(self.src.ranks() | self.dst.ranks()) > 1:
            return self._publish_direct_delta(model, version)
        if not delta:
            self._base = None
            self._publish_full(model, version)
            return
        # the next base must not change under it: a piece that is a view of the live weights (same dtype, the
        # identity plan) is copied; a cast or a fresh buffer is already its own
        live = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        pieces = {k: v.detach().clone() if v.untyped_storage().data_ptr() in live else v
                  for k, v in self._gather(model, version, buffers=False).items()}
        full = sum(v.numel() * v.element_size() for v in pieces.values())
        base = self._base
        if base is None and self.engine.capabilities.deltas:
            self.engine.expect_deltas()  # deltas follow: an engine that needs a copy to apply them keeps it now
        if base is not None:
            try:
                self._publish_delta(pieces, version, base, full)
                self._base = DeltaBase(version, pieces)
                return
            except WeightPublishError as e:  # a base the engine does not hold, a checksum: the full weights instead
                self.last = {"delta_fallback": str(e)}
        self.engine.begin(version)
        self.engine.stage(pieces)
        self.engine.commit()
        self.last |= {"publish_bytes": full, "publish_full_bytes": full, "delta_frac": 1.0}
        self._base = DeltaBase(version, pieces)

    def _publish_direct_delta(self, model: torch.nn.Module, version: int) -> None:
        """Delta publication across processes, every rank together: when every rank holds the last publication
        (its source shards and its received pieces, both of version ``V``) and every engine serves ``V``, each
        planned slice crosses as its changed elements (:func:`~hyperrl.rollout.delta_direct.execute_direct_delta`),
        applied to a copy of the receiver's last pieces and checked slice by slice; the engine then stages the
        new pieces in one transaction as a full publication would. Otherwise — or when any slice fails its
        checksum on any rank — the full weights go by the direct plan, and ``last["delta_fallback"]`` says why.
        ``last``: ``publish_bytes`` / ``publish_full_bytes`` on the wire over all ranks, ``delta_frac`` of the
        elements sent."""
        from hyperrl.rollout.delta_direct import execute_direct_delta

        par = self.parallel
        if par is None:
            raise WeightPublishError("delta publication across processes: the ranks agree through the run's parallel "
                                     "strategy — Publisher(..., parallel=hyperrl.distributed.make_parallel(dims))")

        live = {k: local(p).data_ptr() for k, p in model.named_parameters()}
        shards = {k: v.detach().clone() if v.data_ptr() == live.get(k) else v  # the next base: never a live view
                  for k, v in self.shards(model).items()}
        base, current = self._base, self.engine.policy_version
        why = "no earlier publication" if base is None else None
        if base is not None and current != base.version:
            why = f"a delta against version {base.version}, but this engine serves version {current}"
        at = -1 if base is None else base.version
        flags = par.min_over_ranks([int(why is None), at, -at])
        if bool(flags[0]) and int(flags[1]) == -int(flags[2]):  # every rank ready, at one base version
            # the receiver's copy of its last pieces is updated in place (on a failure the full weights replace it);
            # a fan-out forward (phase ≥ 1) reads the old pieces, so then a copy
            forwards = any(t.phase for t in self.plan)
            pieces = {k: v.clone() for k, v in base.pieces.items()} if forwards else base.pieces
            res = execute_direct_delta(self.plan, self.rank, shards, base.shards, pieces, base.pieces,
                                       max_bytes=getattr(self.executor, "max_bytes", 128 << 20), codec=self._codec)
            sums = par.sum_over_ranks([len(res["errors"]), res["bytes"], res["full"], res["changed"], res["numel"]])
            if not sums[0]:
                self._base = None  # until the engine holds it (a refused commit leaves no base to delta against)
                self.engine.begin(version, base=base.version)
                self.engine.stage(pieces)
                self.engine.commit()
                self._base = DeltaBase(version, pieces, shards)
                self.last = {"publish_bytes": float(sums[1]), "publish_full_bytes": float(sums[2]),
                             "delta_frac": float(sums[3] / max(float(sums[4]), 1.0))}
                return
            why = res["errors"][0] if res["errors"] else None
        reasons = par.gather_objects(why)
        said = next((f"rank {r}: {w}" for r, w in enumerate(reasons) if w), None)
        self._base = None
        pieces = self._publish_full(model, version, keep=True)
        self._base = DeltaBase(version, pieces, shards)
        full = sum(t.nbytes for t in self.plan if not t.local and t.src_rank == self.rank)
        total = par.sum_over_ranks([full])[0]
        self.last = {"publish_bytes": total, "publish_full_bytes": total, "delta_frac": 1.0}
        if base is not None and said:
            self.last["delta_fallback"] = said

    def _publish_full(self, model: torch.nn.Module, version: int, *, keep: bool = False) -> dict[str, torch.Tensor]:
        """One full publication: ``begin`` before gathering (an in-place engine's buffers belong to the
        transaction; a failed gather aborts it), stage, commit. ``keep``: the pieces staged are copies, returned
        as the next delta base (never the engine's own buffers)."""
        self.engine.begin(version)
        try:
            pieces = self._gather(model, version)
        except WeightPublishError:
            self.engine.abort()
            raise
        if keep:
            pieces = {k: v.detach().clone() for k, v in pieces.items()}
        self.engine.stage(pieces)
        self.engine.commit()
        return pieces

    def _gather(self, model: torch.nn.Module, version: int, *, buffers: bool = True) -> dict[str, torch.Tensor]:
        """:meth:`gather`, an executor's failure reported as a ``WeightPublishError`` naming the version."""
        try:
            return self.gather(model, buffers=buffers)
        except Exception as e:
            raise WeightPublishError(f"publication of version {version} failed in {type(self.executor).__name__}: "
                                     f"{e!r}; still serving version {self.engine.policy_version}") from e

    def _publish_delta(self, pieces: dict, version: int, base, full: int) -> None:
        """One delta publication of ``pieces`` against ``base`` (:class:`DeltaBase`), the last published."""
        from hyperrl.rollout.delta import codec_of, encode_delta

        deltas = {k: encode_delta(v, base.pieces[k], self._codec) for k, v in pieces.items()}
        self.engine.begin(version, base=base.version)
        self.engine.stage_deltas(deltas)
        self.engine.commit()
        numel = sum(d.numel for d in deltas.values())
        self.last = {"publish_bytes": sum(d.nbytes for d in deltas.values()), "publish_full_bytes": full,
                     "delta_frac": sum(d.changed for d in deltas.values()) / max(numel, 1),
                     "delta_dense_tensors": sum(codec_of(d).whole for d in deltas.values())}
