"""The rollout-engine protocol shared by every engine (transformers on CPU, vLLM).

``generate(prompts, sampling, n)`` takes prompts as **token-id lists** (token-first: the ids the
engine samples from are the ids the trainer trains on) and returns a validated trajectory batch:
prompt + response ids right-padded, fp32 log-probs of the sampled tokens, the action mask (the
generated tokens, including the EOS the policy sampled), the serving ``policy_version`` and group
ids (the ``n`` samples of prompt ``i`` share ``group_offset + i``).

``layout(replicas)`` describes the engine's own parameters as a
:class:`~hyperrl.sharding.DstLayout` (``replicas`` engine copies on a ``dp`` axis — one per
trainer rank when colocated); a publisher plans into it.

Publication is one versioned transaction, ``begin(version) → stage(pieces)… → commit()`` (or
``abort()``): every piece is checked as it arrives (known name, shape, finite values) and the set
is checked complete at commit, before anything is applied — so a failure mid-publication (a bad
tensor, a publisher dying mid-way, a stale version) leaves version ``V`` serving, never a mix.
``load_weights(weights, version)`` is the one-call form (begin, stage everything, commit).

An engine whose ``capabilities.resumable`` is set also has ``generate_requests(requests, sampling, abort=)``
(:mod:`hyperrl.rollout.requests`): sampling keyed by (seed, sample_uid, token index), generation
that stops at a decode step when asked (rows ``finish_reason = aborted``) and continues from the
exact partial tokens — what asynchronous RL needs.
:class:`TransactionalEngine` implements the protocol over an engine's ``_expected()`` parameter
shapes and ``_apply(staged)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from hyperrl.errors import HyperRLError
from hyperrl.sampling import SamplingParams

__all__ = ["SamplingParams", "RolloutEngine", "Capabilities", "WeightPublishError", "DeltaError", "WeightTransaction",
           "TransactionalEngine", "KeptCopy", "ResumableEngine", "DeltaEngine", "AdapterEngine", "BufferEngine",
           "SleepingEngine", "CAPABILITY_PROTOCOLS", "check_capabilities", "transformers_capabilities",
           "vllm_capabilities"]


class WeightPublishError(HyperRLError, RuntimeError):
    """A publication was refused or failed; the engine still serves the previous version."""


class DeltaError(WeightPublishError):
    """A delta publication that cannot be applied: another base version, a wrong size, or a checksum mismatch
    (the message names the tensor); :mod:`hyperrl.rollout.delta`."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond ``generate`` and the publication transaction — declared, never
    probed: callers read ``engine.capabilities``.

    * ``keyed`` — ``generate_requests`` samples each token keyed by (seed, sample_uid, index), so an
      interruption is invisible and a synchronous run agrees with an asynchronous one at η = 0;
    * ``resumable`` — has ``generate_requests(requests, sampling, abort=)``: stops at a decode step
      when asked and continues from the exact partial tokens (asynchronous RL needs it);
    * ``shared_weights`` — serves the trainer's own modules (no copy: an asynchronous run, or a
      compiled policy, cannot use it);
    * ``lora_adapters`` — receives LoRA adapters (``load_lora(policy, version)``) instead of merged
      weights;
    * ``buffers`` — exposes its destination buffers (``buffers()``) for the publisher to write in place;
    * ``routes`` — records ``routed_experts`` (the experts every token was routed to) when it serves a
      mixture-of-experts model (routing replay, docs/moe.md);
    * ``deltas`` — applies delta publications (``begin(base=)``, ``stage_deltas``: only the changed weights travel);
    * ``images`` — generates from prompts with images (a vision-language policy's rows);
    * ``fp32_head`` — computes the LM head in fp32 when the policy does (``model.lm_head_fp32``);
    * ``tp`` — its copy is split over TP groups of ``tp`` consecutive trainer ranks (1: whole on each rank; the
      trainer's ``run.tp`` must be the same);
    * ``sleeps`` — frees its memory while the trainer updates (``sleep()``; the next publication wakes it);
    * ``devices`` — the accelerators one engine takes (vLLM: its ``tp`` workers, one GPU each — on CPU one core group
      each), checked against the machine when an executor starts several replicas;
    * ``stats`` — keeps its own scheduler's figures (``pop_stats()`` → ``engine_*`` step metrics; vLLM's).
    """

    keyed: bool = False
    resumable: bool = False
    shared_weights: bool = False
    lora_adapters: bool = False
    buffers: bool = False
    routes: bool = False
    deltas: bool = False
    images: bool = False
    fp32_head: bool = False
    tp: int = 1
    sleeps: bool = False
    devices: int = 1
    stats: bool = False


def transformers_capabilities(*, share_weights: bool = False, tp: int = 1, **_) -> Capabilities:
    """What the transformers engine built with these arguments can do — its registration's declaration and the
    built engine's ``capabilities`` (one function: declared once)."""
    return Capabilities(keyed=True, resumable=True, shared_weights=share_weights, routes=True, deltas=True,
                        images=True, fp32_head=tp == 1, tp=tp)


def vllm_capabilities(*, lora_adapters: bool = False, routed_experts: bool = False, transport: str | None = None,
                      tp: int = 1, sleep: int = 0, colocated: bool = False, **_) -> Capabilities:
    """What the vLLM engine built with these arguments can do (its registration's declaration and the built
    engine's): ``buffers`` where its weight transport writes in place (None: ``shm``, ``file`` without /dev/shm)
    and the engine is one worker wide (``tp > 1``: each worker's shards are cut from whole parameters). Separate
    engine processes keep their TP inside (vLLM's own workers): ``Capabilities.tp`` stays 1; ``colocated`` puts one
    worker on each trainer rank (``tp`` = the trainer's ``run.tp``), generating in lockstep — not resumable, no
    deltas (the direct plan delivers whole versions)."""
    from hyperrl.rollout.transports import transport_class

    try:
        in_place = transport_class(transport or ("shm" if Path("/dev/shm").is_dir() else "file")).in_place
    except ValueError:  # an unknown transport: refused at load, naming the registered ones (_vllm_arguments)
        in_place = False
    return Capabilities(resumable=not colocated, lora_adapters=lora_adapters, routes=routed_experts,
                        buffers=in_place and tp == 1 and not colocated, deltas=not colocated, sleeps=bool(sleep),
                        tp=tp if colocated else 1, devices=tp, stats=not colocated)


@runtime_checkable
class RolloutEngine(Protocol):
    """A rollout engine: generation over token-id prompts, its parameter layout, and the
    versioned publication transaction (see the module doc); ``capabilities`` declares the rest."""

    capabilities: Capabilities

    @property
    def policy_version(self) -> int: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1, *,
                 group_offset: int = 0) -> TensorDict: ...

    def layout(self, replicas: int = 1): ...

    def begin(self, version: int) -> None: ...

    def stage(self, pieces: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None: ...


@runtime_checkable
class ResumableEngine(Protocol):
    """What an engine declaring ``capabilities.resumable`` has (:mod:`hyperrl.rollout.requests`)."""

    def generate_requests(self, requests, sampling: SamplingParams, *, abort=None) -> TensorDict: ...


@runtime_checkable
class DeltaEngine(Protocol):
    """What an engine declaring ``capabilities.deltas`` has (:mod:`hyperrl.rollout.delta`)."""

    def begin(self, version: int, *, partial: bool = False, base: int | None = None) -> None: ...

    def stage_deltas(self, deltas) -> None: ...

    def expect_deltas(self) -> None: ...


@runtime_checkable
class AdapterEngine(Protocol):
    """What an engine declaring ``capabilities.lora_adapters`` has: the LoRA adapters of ``policy`` as ``version``."""

    def load_lora(self, policy, version: int) -> None: ...


@runtime_checkable
class BufferEngine(Protocol):
    """What an engine declaring ``capabilities.buffers`` has: its destination buffers, for the publisher to write."""

    def buffers(self) -> dict[str, torch.Tensor] | None: ...


@runtime_checkable
class SleepingEngine(Protocol):
    """What an engine declaring ``capabilities.sleeps`` has: ``sleep()`` before the update (the next publication's
    ``begin`` wakes its weights, ``commit`` its cache)."""

    def sleep(self) -> None: ...


# a declared capability → the optional members the loop then calls (checked where an engine is built)
CAPABILITY_PROTOCOLS = {"resumable": ResumableEngine, "deltas": DeltaEngine, "lora_adapters": AdapterEngine,
                        "buffers": BufferEngine, "sleeps": SleepingEngine}


def check_capabilities(engine, where: str = "engine") -> None:
    """An engine declaring a capability has the members it promises (:data:`CAPABILITY_PROTOCOLS`), else a
    ``TypeError`` naming the flag and the missing members — at build, not at the first publication."""
    for flag, proto in CAPABILITY_PROTOCOLS.items():
        if getattr(engine.capabilities, flag) and not isinstance(engine, proto):
            members = [m for m, v in vars(proto).items() if callable(v) and not m.startswith("_")]
            missing = [m for m in members if not callable(getattr(engine, m, None))]
            raise TypeError(f"{where}: {type(engine).__name__} declares capabilities.{flag} but lacks "
                            f"{', '.join(sorted(missing))} ({proto.__name__})")


def _all_finite(t: torch.Tensor) -> bool:
    """Every element finite. One reduction pass (a NaN or inf anywhere makes the sum non-finite;
    15× faster than ``isfinite(t).all()`` on a 0.6B model here); only a non-finite sum — maybe an
    overflow of finite values — is confirmed element by element."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


class WeightTransaction:
    """One publication in flight. ``add(name, t)`` checks a piece as it arrives (known name — a
    publisher sending only the canonical name of tied weights fills its ``aliases`` — shape, finite
    values, not sent twice); ``complete()`` checks that nothing is missing and returns the staged
    pieces. The engine applies them only after ``complete()``: a failure anywhere leaves it serving
    ``current``."""

    def __init__(self, expected: Mapping[str, torch.Tensor], version: int, current: int, *, partial: bool = False,
                 aliases: Mapping[str, str] | None = None):
        if version <= current:
            raise WeightPublishError(f"version {version}: must be greater than the serving version {current}")
        self.expected, self.version, self.current, self.partial = expected, version, current, partial
        self.aliases = dict(aliases or {})
        self.staged: dict[str, torch.Tensor] = {}
        self.kept: dict[str, torch.Tensor] = {}  # copies of the staged pieces, for a KeptCopy

    def _refuse(self, why: str) -> WeightPublishError:
        return WeightPublishError(f"{why}; refusing version {self.version} (still serving version {self.current})")

    def check_delta(self, name: str, delta) -> None:
        """What can be checked of a delta before it is applied: a known name, not staged twice, the number of
        elements, its new elements finite (an xor delta's are known only once applied)."""
        want = self.expected.get(name)
        if want is None:
            raise self._refuse(f"unknown parameters [{name!r}]")
        if name in self.staged:
            raise self._refuse(f"{name}: staged twice")
        if delta.numel != want.numel():
            raise self._refuse(f"{name}: a delta of {delta.numel} elements for a tensor of {want.numel()}")
        if delta.elementwise and delta.values.is_floating_point() and not _all_finite(delta.values):
            raise self._refuse(f"{name}: contains NaN/inf")

    def add(self, name: str, t: torch.Tensor, *, finite_checked: bool = False) -> torch.Tensor:
        """Check and stage ``t`` as ``name`` (``finite_checked``: the caller checked its values already — a
        delta's new elements)."""
        want = self.expected.get(name)
        if want is None:
            raise self._refuse(f"unknown parameters [{name!r}]")
        if name in self.staged:
            raise self._refuse(f"{name}: staged twice")
        if tuple(t.shape) != tuple(want.shape):
            raise self._refuse(f"{name}: shape {list(t.shape)}, engine has {list(want.shape)}")
        if not finite_checked and t.is_floating_point() and not _all_finite(t):
            raise self._refuse(f"{name}: contains NaN/inf")
        self.staged[name] = t
        return t

    def add_all(self, pieces, add=None) -> None:
        """``add`` (default :meth:`add`) every ``(name, tensor)`` of a mapping or iterable; a source
        that fails mid-way is reported with how far it got."""
        add = add or self.add
        items = pieces.items() if isinstance(pieces, Mapping) else pieces
        n = len(self.staged)
        try:
            for name, t in items:
                add(name, t)
                n += 1
        except WeightPublishError:
            raise
        except Exception as e:  # noqa: BLE001 - the publisher failed mid-way: nothing is applied
            raise WeightPublishError(f"publication of version {self.version} failed after {n} tensors: {e!r}; "
                                     f"still serving version {self.current}") from e

    def complete(self) -> dict[str, torch.Tensor]:
        for alias, canon in self.aliases.items():
            if alias not in self.staged and canon in self.staged:
                self.staged[alias] = self.staged[canon]
        missing = sorted(set(self.expected) - set(self.staged))
        if missing and not self.partial:
            raise WeightPublishError(f"incomplete publication: missing {missing[:5]}{' …' if len(missing) > 5 else ''}"
                                     f" ({len(missing)} in all); still serving version {self.current}")
        return self.staged


class KeptCopy:
    """What an engine whose weights live elsewhere (vLLM's worker keeps them packed: they are not read back)
    composes to apply deltas: a copy of the pieces of its last committed publication — one more copy of the model
    in this process's memory — kept once a publisher announces deltas (:meth:`expect`), from the publication under
    way on. ``version``: the publication the copy is of (None: none held)."""

    def __init__(self):
        self.keeping = False
        self.version: int | None = None
        self.pieces: dict[str, torch.Tensor] = {}

    def expect(self) -> None:
        """Deltas follow: keep copies of what is staged from now on."""
        self.keeping = True

    def holds(self, version: int) -> bool:
        """Is the copy of ``version``?"""
        return self.version is not None and self.version == version

    def commit(self, txn: WeightTransaction) -> None:
        """``txn`` committed: its kept pieces are the copy (a partial publication updates the copy of the version
        it was staged on, else leaves none)."""
        if not self.keeping:
            return
        if not txn.partial:
            self.version, self.pieces = txn.version, txn.kept
        elif self.holds(txn.current):
            self.version, self.pieces = txn.version, {**self.pieces, **txn.kept}
        else:
            self.version, self.pieces = None, {}


class TransactionalEngine:
    """``begin / stage / commit / abort`` and ``load_weights`` over the engine's ``_expected()``
    (``name → tensor`` with the shapes it accepts), ``_aliases`` and ``_apply(staged)``; the
    version is bumped only after ``_apply`` returns.

    Deltas (:meth:`stage_deltas`, an engine declaring ``capabilities.deltas``) apply to the weights the engine
    serves — ``_expected()`` when those are its own tensors. An engine whose weights live elsewhere composes a
    :class:`KeptCopy` (``kept_copy``) and applies them to that copy of what it last committed, kept once a
    publisher announces deltas (:meth:`expect_deltas`); a delta that finds no copy is refused and the
    publisher's full publication follows."""

    _txn: WeightTransaction | None = None
    _aliases: Mapping[str, str] = {}
    capabilities: Capabilities = Capabilities()
    kept_copy: KeptCopy | None = None  # an engine whose weights live elsewhere sets one in its constructor

    def begin(self, version: int, *, partial: bool = False, base: int | None = None) -> None:
        """Open the publication of ``version``; ``base``: it is a delta against that version (refused unless the
        engine serves exactly it — the publisher then falls back to a full publication)."""
        if self._txn is not None:
            raise WeightPublishError(f"version {self._txn.version} is still being staged; commit or abort it first")
        if base is not None and base != self.policy_version:
            raise DeltaError(f"a delta against version {base}, but this engine serves version {self.policy_version}; "
                             f"refusing version {version}")
        self._txn = WeightTransaction(self._expected(), version, self.policy_version, partial=partial,
                                      aliases=self._aliases)

    def expect_deltas(self) -> None:
        """A publisher's notice that delta publications follow: an engine whose weights live elsewhere starts
        keeping the copy they apply to (from the publication under way on)."""
        if self.kept_copy is not None:
            self.kept_copy.expect()

    def _delta_base(self) -> Mapping[str, torch.Tensor]:
        """What a delta applies to: the served weights (an engine keeping a copy: the copy)."""
        return self.kept_copy.pieces if self.kept_copy is not None else self._expected()

    def stage_deltas(self, deltas) -> None:
        """Stage ``name → TensorDelta`` pieces (:mod:`hyperrl.rollout.delta`): each applied to the weight this
        engine serves now and its checksum verified before it is staged; a failure aborts the transaction."""
        if self._txn is None:
            raise WeightPublishError("stage_deltas() without begin(version, base=...)")
        if self.kept_copy is not None and not self.kept_copy.holds(self.policy_version):
            version = self._txn.version
            self.abort()
            self.kept_copy.expect()  # from the next publication on
            raise DeltaError(f"a delta against version {self.policy_version}, but this engine holds no copy of it to "
                             f"apply the delta to (it keeps one from its next full publication); refusing version "
                             f"{version}")
        current = self._delta_base()
        items = deltas.items() if hasattr(deltas, "items") else deltas

        def applied():
            for name, d in items:
                self._txn.check_delta(name, d)  # an unknown name is refused as such, not as a missing copy
                if name not in current:
                    raise DeltaError(f"{name}: this engine holds no copy of it to apply a delta to; refusing version "
                                     f"{self._txn.version}")
                yield name, d.apply(current[name], name)

        self.stage(applied())

    def stage(self, pieces) -> None:
        if self._txn is None:
            raise WeightPublishError("stage() without begin(version)")
        try:
            keep = self.kept_copy is not None and self.kept_copy.keeping
            self._txn.add_all(pieces, self._stage_kept if keep else self._stage_one)
        except Exception:
            self.abort()
            raise

    def _stage_kept(self, name: str, t: torch.Tensor) -> None:
        """``_stage_one``, and a copy of the piece kept (as published: the engine's dtype) as the next delta base."""
        self._stage_one(name, t)
        self._txn.kept[name] = t.detach().clone()

    def _stage_one(self, name: str, t: torch.Tensor) -> None:
        self._txn.add(name, t)

    def commit(self) -> None:
        if self._txn is None:
            raise WeightPublishError("commit() without begin(version)")
        txn, self._txn = self._txn, None
        try:
            staged = txn.complete()
            self._apply(staged, txn.version)
        except Exception:
            self._on_abort()
            raise
        self._version = txn.version
        if self.kept_copy is not None:
            self.kept_copy.commit(txn)

    def prepare(self) -> None:
        """Check the staged publication complete — what :meth:`commit` checks before applying — so
        that a group of engines can all agree before any of them commits (two-phase); a refusal
        aborts the transaction."""
        if self._txn is None:
            raise WeightPublishError("prepare() without begin(version)")
        try:
            self._txn.complete()
        except Exception:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the publication in flight (if any); the serving version is untouched."""
        self._txn = None
        self._on_abort()

    def _on_abort(self) -> None:
        pass

    def load_weights(self, weights, version: int, *, partial: bool = False) -> None:
        """The whole transaction in one call."""
        self.begin(version, partial=partial)
        self.stage(weights)
        self.commit()
