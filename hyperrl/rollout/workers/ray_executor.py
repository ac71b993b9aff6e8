"""Rollout workers as Ray actors (``async.executor: {name: ray, workers: N}``).

Each actor holds its own copy of the run's engine (a
:class:`~hyperrl.rollout.hf.TransformersEngine`), born serving the engine's current version. The
learner publishes to one :class:`RayEngine` — the engine protocol over the whole group, planned
into by the :class:`~hyperrl.rollout.publisher.Publisher` like any engine — which ships the
pieces once through Ray's object store (``ray.put``; every actor reads the same object) and
commits in two phases: every live actor begins, stages and checks the set complete
(``prepare``); only if all agree do they commit. A refused piece or an actor past its deadline
aborts the transaction everywhere — the group keeps serving ``V`` — and the error names the
worker. An actor that dies is started again by its :class:`RayWorker` handle from the object
of the *current* version (no version is lost or mixed), up to ``max_restarts`` times; its
requests, which came back to nobody, are generated again from their exact partial tokens.

Why Ray and not ``torch.distributed`` here: the workers come and go (a restarted actor joins a
running group), which fixed-world process groups cannot express; the object store gives every
actor on a node the same copy of a publication. Interruption is a call id the actor checks
before every decode step (a threaded actor: ``abort`` runs while ``generate_requests`` does).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from hyperrl.rollout.base import DeltaError, TransactionalEngine, WeightPublishError
from hyperrl.rollout.workers.base import LIVE, WorkerDied, WorkerError, Workers, decode_flag

__all__ = ["RayEngine", "RayWorker", "ray_workers"]


class _Flag:
    """``is_set()`` of one generation call: has the driver asked that call to stop?"""

    def __init__(self, aborted: set, call: int):
        self.aborted, self.call = aborted, call

    def is_set(self) -> bool:
        return self.call in self.aborted


def _to_store(pieces: dict) -> dict:
    """Weights for Ray's object store as numpy arrays (:func:`~hyperrl.rollout.delta.tensor_to_wire`: one copy into
    the store, none out of it)."""
    from hyperrl.rollout.delta import tensor_to_wire

    return {k: tensor_to_wire(t) for k, t in pieces.items()}


def _from_store(packed: dict) -> dict:
    """:func:`_to_store`'s weights as (read-only) tensors over the store's arrays."""
    from hyperrl.rollout.delta import tensor_from_wire

    return {k: tensor_from_wire(w) for k, w in packed.items()}


class _EngineActor:
    """One rollout engine in its own process (made a Ray actor by :func:`_actor_class`), built from
    ``spec`` (with ``model``, the object every transformers actor is born from, when there is one)."""

    def __init__(self, spec, model, born: int, weights, version: int, threads: int, keep: bool = False):
        self.threads = threads
        self._threads()
        self.engine = spec.build(version=born, **({"model": model} if model is not None else {}))
        self._publishing = threading.Lock()  # one publication call at a time (a threaded actor runs calls at once)
        if keep:  # the group publishes deltas
            self.engine.expect_deltas()
        if weights is not None and version > born:  # a restart: the current version, checked like any publication
            self.engine.load_weights(_from_store(weights), version)
        self._aborted: set[int] = set()

    def _threads(self) -> None:
        """torch's intra-op thread count is per calling thread, and a threaded actor runs its calls on a
        pool: set it on every call that computes."""
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "version": self.engine.policy_version}

    def describe(self) -> dict:
        """What the group engine publishes into (read from this engine, the group's first): its layout,
        the shapes and dtypes it accepts, its tied names, pad id and capabilities."""
        e = self.engine
        return {"layout": e.layout(1), "expected": {k: (tuple(v.shape), v.dtype) for k, v in e._expected().items()},
                "aliases": dict(e._aliases), "pad_id": e.pad_id, "capabilities": e.capabilities}

    def generate_requests(self, requests, sampling, call: int, stop_after: int | None):
        self._threads()
        flag = decode_flag(_Flag(self._aborted, call), stop_after)
        try:
            return self.engine.generate_requests(requests, sampling, abort=flag), flag.result
        except Exception:
            self._exit_if_broken()
            raise
        finally:
            self._aborted.discard(call)

    def abort(self, call: int) -> None:
        self._aborted.add(call)

    def generate(self, prompts, sampling, n: int, group_offset: int):
        self._threads()
        try:
            return self.engine.generate(prompts, sampling, n, group_offset=group_offset)
        except Exception:
            self._exit_if_broken()
            raise

    def prepare(self, weights, version: int, keep: bool = False) -> None:
        """Stage a full publication (``keep``: the group publishes deltas — the engine keeps what they
        apply to, if it needs a copy)."""
        self._threads()
        with self._publishing:
            if keep:
                self.engine.expect_deltas()
            self.engine.begin(version)
            self.engine.stage(_from_store(weights))
            self.engine.prepare()

    def prepare_delta(self, deltas, version: int, base: int) -> None:
        """Stage a delta publication against ``base`` (refused by an engine serving another version; each
        tensor's checksum verified after it is applied)."""
        from hyperrl.rollout.delta import from_wire

        self._threads()
        with self._publishing:
            self.engine.begin(version, base=base)
            self.engine.stage_deltas({k: from_wire(w) for k, w in deltas.items()})
            self.engine.prepare()

    def commit(self) -> int:
        with self._publishing:
            try:
                self.engine.commit()
            except Exception:
                self._exit_if_broken()
                raise
            return self.engine.policy_version

    def _exit_if_broken(self) -> None:
        """An engine that can serve nothing any more (a vLLM TP worker died: its executor stopped) ends this actor,
        so the group restarts it serving the current version — the path of any actor that dies."""
        if getattr(self.engine, "_broken", None):
            os._exit(1)

    def cancel(self) -> None:
        """Abort the publication staged here (after a staging call still running has finished)."""
        with self._publishing:
            self.engine.abort()


_ACTOR = None


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(max_concurrency=4, max_restarts=0)(_EngineActor)
    return _ACTOR


def _kill(actor) -> None:
    """Kill ``actor`` for good (no restart by Ray: its handle starts a new one); one already gone is fine."""
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001, S110 — already gone
        pass


def _cause(e: BaseException) -> BaseException:
    """The actor's own exception inside Ray's wrapper."""
    return getattr(e, "cause", None) or e


class RayWorker:
    """The driver's handle on one actor: generation with a sticky interrupt, restart after death."""

    def __init__(self, group: RayEngine, index: int, actor):
        self.group, self.name, self.restarts, self.error = group, f"rollout-worker-{index}", 0, None
        self._lock, self._ids, self._call, self._interrupted = threading.Lock(), itertools.count(), None, False
        self.actor = actor

    def generate_requests(self, requests, sampling, stop_after: int | None = LIVE):
        import ray

        if self.error is not None:
            raise self.error
        with self._lock:
            call = self._call = next(self._ids)
            ref = self.actor.generate_requests.remote(requests, sampling, call, stop_after)
            if self._interrupted:
                self.actor.abort.remote(call)
        try:
            return ray.get(ref)  # no deadline here: the learner's waits carry it
        except ray.exceptions.RayActorError as e:
            raise WorkerDied(self.name, type(e).__name__) from e
        finally:
            with self._lock:
                self._call = None

    def generate(self, prompts, sampling, n: int, group_offset: int = 0):
        """Plain generation (evaluation); a dead actor is restarted once and asked again."""
        import ray

        for attempt in (0, 1):
            try:
                return ray.get(self.actor.generate.remote(prompts, sampling, n, group_offset),
                               timeout=self.group.timeout_s)
            except ray.exceptions.RayActorError:
                if attempt:
                    raise
                self.restart()

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            if self._call is not None:
                self.actor.abort.remote(self._call)

    def resume(self) -> None:
        with self._lock:
            self._interrupted = False

    def restart(self) -> None:
        """A new actor serving the group's current version (its object), counted against
        ``max_restarts``; past them the worker fails with an error naming it."""
        self.restart_at(*self.group.current())

    def restart_at(self, version: int, weights) -> None:
        if self.restarts >= self.group.max_restarts:
            raise WorkerError(f"{self.name} died and was restarted {self.restarts} times already "
                              f"(async.executor.max_restarts={self.group.max_restarts}); giving up")
        self.restarts += 1
        _kill(self.actor)
        self.actor = self.group._ready(self.name, self.group._start(version, weights), version)

    def info(self) -> dict:
        import ray

        return ray.get(self.actor.info.remote(), timeout=self.group.timeout_s)


class RayEngine(TransactionalEngine):
    """The engine protocol over a group of actor engines: ``layout`` and the checks of each piece
    are the group's first engine's (names, shapes, finite values — before anything is shipped);
    ``commit`` publishes to every actor in two phases (module doc). A delta publication is checked
    here (names, sizes, the new elements finite), then only the deltas travel, each actor applying
    them to what it serves and verifying every checksum; an actor at another version, or a checksum
    it cannot verify, aborts the publication everywhere (the publisher then publishes the full
    weights). An actor born again gets the last full publication with the deltas since applied to
    it. ``source``: a local
    :class:`~hyperrl.rollout.hf.TransformersEngine` (each actor gets a copy of its model) or an
    :class:`~hyperrl.rollout.engines.EngineSpec` each actor builds its engine from (vLLM: the
    learner's process never starts one)."""

    def __init__(self, source, *, workers: int, num_cpus: float, threads: int, max_restarts: int,
                 timeout_s: float):
        import ray

        from hyperrl.rollout.engines import EngineSpec
        from hyperrl.rollout.hf import TransformersEngine

        if workers < 1:
            raise ValueError(f"async.executor.workers={workers}: must be ≥ 1")
        if isinstance(source, EngineSpec):
            self._spec, self._model, self._born, self._gpus = source, None, 0, source.gpus
        elif type(source) is TransformersEngine and not source.shared:  # (subclasses — the TP engine — split it)
            device = torch.device(source.device).type  # on an accelerator each actor gets one (Ray sets it)
            self._spec = EngineSpec("hyperrl.rollout.hf:TransformersEngine", {"pad_id": source.pad_id,
                                                                             "device": device})
            self._model, self._born, self._gpus = ray.put(source.model.cpu()), source.policy_version, \
                float(device == "cuda")  # every actor is born from this object
        else:
            raise ValueError(f"async.executor=ray: rollout workers copy a transformers engine (rollout.engine: "
                             f"transformers, share_weights: false, tp: 1) or build a vLLM engine each "
                             f"(rollout.engine: vllm), got {type(source).__name__}")
        self.num_cpus, self.threads = num_cpus, threads
        self.max_restarts, self.timeout_s = max_restarts, timeout_s
        self._version = self._born
        self._weights = None  # the last full publication's pieces (None: the born engine is the current version)
        self._chain: list = []  # (version, deltas) published since it
        self._deltas = None  # (base, deltas) of the delta publication being staged
        self._actors_keep = False  # deltas follow: the actors' engines keep what they apply them to
        self._lock = threading.RLock()  # the last full publication and the chain: driver threads restart workers
        self._folding = threading.Lock()  # one fold of the chain at a time
        self._folder = self._folding_future = None  # the background fold's thread and its last run
        self._fold_failed = None  # (full publication, first delta's version) of a chain a background fold failed on
        self._weights_version = self._born  # the version _weights holds
        actors = [self._start(self._version, None) for _ in range(workers)]  # they start in parallel
        self.workers = [RayWorker(self, i, self._ready(f"rollout-worker-{i}", a, self._version))
                        for i, a in enumerate(actors)]
        d = ray.get(self.workers[0].actor.describe.remote(), timeout=self.timeout_s)
        self._layout, self._aliases, self.pad_id = d["layout"], d["aliases"], d["pad_id"]
        self._meta = {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in d["expected"].items()}
        self._full_bytes = sum(math.prod(p.local_shape(0)) * p.dtype.itemsize for p in self._layout.params.values())
        # what the group can do: its engines' generation; publication is the group's own (no buffers to fill, no
        # adapters path, never the trainer's modules)
        self.capabilities = replace(d["capabilities"], buffers=False, lora_adapters=False, shared_weights=False,
                                    stats=False)  # the actors keep their engines' figures

    @property
    def policy_version(self) -> int:
        return self._version

    def layout(self, replicas: int = 1):
        if replicas != 1:
            raise ValueError(f"RayEngine.layout({replicas}): the group is published to from one learner process")
        return self._layout

    def _expected(self) -> dict[str, torch.Tensor]:
        return self._meta

    def _start(self, version: int, weights):
        """A new actor (not yet waited for) serving ``version``: the born engine, then ``weights``."""
        gpus = {"num_gpus": self._gpus} if self._gpus else {}
        return _actor_class().options(num_cpus=self.num_cpus, scheduling_strategy="SPREAD", **gpus).remote(
            self._spec, self._model, self._born, weights, version, self.threads, self._actors_keep)

    def _ready(self, name: str, actor, version: int):
        """``actor`` once it answers (deadline ``timeout_s``) serving ``version``; else killed and an error."""
        import ray

        try:
            info = ray.get(actor.info.remote(), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 — a start that failed or hung is the worker's error
            ray.kill(actor, no_restart=True)
            raise WorkerError(f"{name}: did not start serving version {version} within {self.timeout_s:g} s: "
                              f"{_cause(e)!r}") from e
        if info["version"] != version:
            raise WorkerError(f"{name}: started serving version {info['version']}, expected {version}")
        return actor

    def _gather(self, calls: dict):
        """Wait (deadline ``timeout_s``) for one call per worker: (results, dead, refused, stuck)."""
        import ray

        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=self.timeout_s)
        ready, ok, dead, refused, stuck = set(ready), {}, [], {}, []
        for w, ref in calls.items():
            if ref not in ready:
                stuck.append(w)
                continue
            try:
                ok[w] = ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(w)
            except Exception as e:  # noqa: BLE001 — the actor refused: reported by name
                refused[w] = _cause(e)
        return ok, dead, refused, stuck

    def expect_deltas(self) -> None:
        """Deltas follow: every actor's engine keeps what they apply to (if it needs a copy) from the
        publication under way on — and an actor born again, from its start."""
        self._actors_keep = True

    def stage_deltas(self, deltas) -> None:
        """Check each delta here (:meth:`~hyperrl.rollout.base.WeightTransaction.check_delta`) before anything is
        shipped; :meth:`_apply` ships the deltas themselves, and every actor applies them to what it serves and
        verifies every checksum (the group holds no weights: the actors' are the copies)."""
        if self._txn is None:
            raise WeightPublishError("stage_deltas() without begin(version, base=...)")
        txn, deltas = self._txn, dict(deltas.items() if hasattr(deltas, "items") else deltas)
        try:
            for name, d in deltas.items():
                txn.check_delta(name, d)
                txn.staged[name] = self._meta[name]  # a placeholder: the actors hold the tensors
        except Exception:
            self.abort()
            raise
        self._deltas = (self.policy_version, {k: d for k, d in deltas.items() if k not in self._aliases})

    def _on_abort(self) -> None:
        self._deltas = None

    def current(self) -> tuple[int, object]:
        """``(version, pieces)`` for an actor born again, one consistent pair: the pieces an object in Ray's store
        (None: the born engine is that version) — the last full publication with the deltas since folded into it
        (:meth:`_fold`, again while deltas committed meanwhile remain)."""
        while True:
            with self._lock:
                if not self._chain:
                    return self._weights_version, self._weights
            self._fold()

    def _fold(self) -> None:
        """Apply the chain of deltas to a copy of the last full publication and make that the full publication
        (one fold at a time; the group's lock held only to read and swap, so publications go on meanwhile — a
        delta committed during the fold stays in the chain, a full publication during it makes the fold moot,
        and the fold stops as soon as it sees one)."""
        import ray

        from hyperrl.rollout.delta import apply_delta_

        def moot() -> bool:
            with self._lock:
                return self._weights is not ref

        with self._folding:
            with self._lock:
                ref, chain = self._weights, list(self._chain)
            if not chain:
                return
            if ref is None:
                raise WorkerError(f"no full publication to rebuild version {chain[-1][0]} from")
            pieces = {k: v.clone() for k, v in _from_store(ray.get(ref)).items()}
            for version, deltas in chain:
                if moot():
                    return
                for name, d in deltas.items():
                    apply_delta_(pieces[name], d, f"{name} (version {version})")
            if moot():
                return
            folded = ray.put(_to_store(pieces))
            del pieces
            with self._lock:
                same = len(self._chain) >= len(chain) and all(a is b for a, b in zip(self._chain, chain))
                if self._weights is ref and same:
                    self._weights, self._weights_version = folded, chain[-1][0]
                    self._chain = self._chain[len(chain):]

    def _fold_in_background(self) -> None:
        """:meth:`_fold` on one kernel thread (the publication's passes keep the pool); a failure is said once
        per chain (a warning naming it) and that chain is not folded again in the background — a restart folds
        it and raises the error where it matters."""
        from hyperrl.rollout import delta_kernels

        with self._lock:
            head = (self._weights, self._chain[0][0] if self._chain else None)
        if head == self._fold_failed:
            return
        try:
            with delta_kernels.threads(1):
                self._fold()
        except Exception as e:  # noqa: BLE001 — a background job: said, not raised
            self._fold_failed = head
            warnings.warn(f"the Ray group could not fold its delta chain (from version {head[1]}) into a full "
                          f"copy for restarts: {e!r}; an actor born again will fold it and report the error",
                          RuntimeWarning, stacklevel=1)

    def _fold_later(self) -> None:
        """:meth:`_fold_in_background` on the group's folding thread, off the publication's path; never raises
        (it runs after the actors have committed)."""
        try:
            if self._folder is None:
                self._folder = ThreadPoolExecutor(1, thread_name_prefix="hyperrl-ray-fold")
            if self._folding_future is None or self._folding_future.done():
                self._folding_future = self._folder.submit(self._fold_in_background)
        except RuntimeError as e:  # the group closing, the interpreter exiting: restarts fold it themselves
            warnings.warn(f"the Ray group's background fold was not started: {e!r}", RuntimeWarning, stacklevel=1)

    def folded(self) -> None:
        """Wait for a fold running in the background (:meth:`close` waits for it too)."""
        if self._folding_future is not None:
            self._folding_future.result()

    def _apply(self, staged: dict[str, torch.Tensor], version: int) -> None:
        import ray

        from hyperrl.rollout.delta import to_wire

        live = [w for w in self.workers if w.error is None]
        full, deltas = None, None
        if self._deltas is not None:
            base, deltas = self._deltas
            # one copy for all actors, only the changed elements, as numpy arrays (no copy through the serializer)
            ref = ray.put({k: to_wire(d) for k, d in deltas.items()})
            calls = {w: w.actor.prepare_delta.remote(ref, version, base) for w in live}
        else:
            full = ray.put(_to_store({k: t for k, t in staged.items() if k not in self._aliases}))  # one for all actors
            calls = {w: w.actor.prepare.remote(full, version, self._actors_keep) for w in live}
        _, dead, refused, stuck = self._gather(calls)
        if refused or stuck:
            self._cancel([w for w in live if w not in dead and w not in stuck], stuck)
            if refused:
                w, e = next(iter(refused.items()))
                cls = DeltaError if isinstance(e, DeltaError) else WeightPublishError  # a delta: publisher goes full
                raise cls(f"{w.name} refused version {version}: {e}; the group still serves version {self._version}")
            raise WorkerError(f"{', '.join(w.name for w in stuck)}: no answer within {self.timeout_s:g} s while "
                              f"staging version {version}; the group still serves version {self._version}")
        _, dead2, refused2, stuck2 = self._gather({w: w.actor.commit.remote() for w in live if w not in dead})
        # every live actor serves the new version from here: nothing below may fail the commit
        self._deltas = None
        with self._lock:
            if full is not None:
                self._weights, self._weights_version, self._chain = full, version, []
            else:
                self._chain.append((version, deltas))
        gone = dead + dead2 + list(refused2) + stuck2
        if not gone:
            with self._lock:
                heavy = sum(d.nbytes for _, ds in self._chain for d in ds.values()) >= self._full_bytes
            if heavy:
                self._fold_later()  # deltas outweighing the model: folded into it, off the publication's path
            return
        try:
            _, full = self.current()  # born again from the whole new version
        except Exception as e:  # noqa: BLE001 — the chain stays (folded at the next restart); the gone report it
            for w in gone:
                w.error = WorkerError(f"{w.name}: died while version {version} was committed and could not be "
                                      f"born again at it: {e!r}")
            return
        for w in gone:  # gone (or wedged) mid-publication: born again at V+1
            try:
                w.restart_at(version, full)
            except WorkerError as e:
                w.error = e  # its driver thread reports it at its next generation

    def _cancel(self, workers: list, stuck: list) -> None:
        """Abort the staged publication on ``workers`` and wait for it (a cancel runs after the actor's staging
        call, never beside it); ``stuck`` actors — or any whose cancel does not return in time — are killed:
        their handles start them again, at the group's version, when their driver threads next call them."""
        late = self._gather({w: w.actor.cancel.remote() for w in workers})[3] if workers else []
        for w in stuck + late:
            _kill(w.actor)

    def generate(self, prompts, sampling, n: int = 1, *, group_offset: int = 0):
        """Plain generation (evaluation) on the first worker."""
        return self.workers[0].generate(prompts, sampling, n, group_offset)

    def close(self) -> None:
        import ray

        if self._folder is not None:  # a background fold finishes (or fails) before Ray goes
            self._folder.shutdown(wait=True)
            self._folder = None
        if not ray.is_initialized():  # Ray is gone (a second close): any Ray call would start it again
            return
        for w in self.workers:
            _kill(w.actor)


def _token_auth() -> bool:
    """Before Ray is imported in this process (Ray reads ``RAY_AUTH_MODE`` once, at import): ask
    for token authentication with a fresh random token, inherited by every process the local
    instance starts. False when that is no longer possible (Ray already imported) or the
    environment decides (``RAY_AUTH_MODE`` set)."""
    import os
    import secrets
    import sys

    if "RAY_AUTH_MODE" in os.environ or "ray" in sys.modules:
        return os.environ.get("RAY_AUTH_MODE") == "token"
    os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", secrets.token_hex(32)
    return True


def _local_ray(num_cpus: int, *, auth: bool) -> None:
    """A local Ray instance only this run can use. Ray 2.58's servers (GCS, raylet, workers) listen
    on every interface and run the cloudpickled work they are sent; the instance hyperrl starts
    therefore requires Ray's token authentication (:func:`_token_auth`). Where Ray was imported
    before hyperrl could ask for it, the instance starts without — and says so. Started with
    ``address="local"``: a bare ``ray.init()`` joins the cluster named in ``<ray temp dir>/ray_current_cluster``
    (left by ``ray start`` or ``ray.cluster_utils.Cluster`` — another job's, or a stale one) and then
    refuses ``num_cpus``."""
    import sys

    import ray

    if not auth:
        print("warning: Ray was imported before hyperrl started it, so the local Ray instance runs without token "
              "authentication (its ports accept any local-network peer); set RAY_AUTH_MODE=token and "
              "RAY_AUTH_TOKEN before starting Python to require it", file=sys.stderr)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def ray_workers(engine, *, workers: int, num_cpus: float, threads: int, address: str | None, max_restarts: int,
                timeout_s: float) -> Workers:
    """Start Ray if needed, the actors, and the group engine (see :func:`~.workers.ray_executor`)."""
    auth = _token_auth() if address is None else False
    import ray

    started = False
    if not ray.is_initialized():
        if address is None:
            _local_ray(max(1, math.ceil(workers * num_cpus)), auth=auth)
        else:
            ray.init(address=address, log_to_driver=False)
        started = True
    group = RayEngine(engine, workers=workers, num_cpus=num_cpus, threads=threads, max_restarts=max_restarts,
                      timeout_s=timeout_s)

    closed = []

    def close():  # once: the collector closes at the run's end and again when it is collected
        if closed:
            return
        closed.append(True)
        group.close()
        if started:
            ray.shutdown()

    return Workers(group, list(group.workers), close)
