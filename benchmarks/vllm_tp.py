"""vLLM's CPU backend with tensor parallelism inside one engine, side by side with one worker (issue 49's start).

Run in the vLLM environment (``bash scripts/setup_vllm.sh``): ``.venv-vllm/bin/python benchmarks/vllm_tp.py``.
For each ``tensor_parallel_size`` a fresh process starts ``vllm.LLM`` on a tiny random Qwen3 (vocab 64, hidden 128,
4 heads / 2 kv heads, fp32, ``enforce_eager``), greedy-generates 4 × 8 tokens twice, and reads every worker's
parameters through ``collective_rpc``. Reports start and generation seconds, whether the tokens equal TP 1's, and
what each worker holds (the vocab-parallel embedding's rows; on CPU vLLM repacks its linear layers, leaving their
``weight`` parameters empty). TP > 1 on a machine with one NUMA node needs ``VLLM_CPU_OMP_THREADS_BIND`` (one core
per rank, ``"0|1"``): vLLM's ``auto`` binding refuses it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(tp: int, model_dir: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=128,
              enforce_eager=True, tensor_parallel_size=tp)
    start = time.perf_counter() - t0
    prompts, sp = [TokensPrompt(prompt_token_ids=[1, 2, 3, 4])] * 4, SamplingParams(max_tokens=8, temperature=0.0,
                                                                                    detokenize=False)
    gens = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        gens.append(time.perf_counter() - t0)

    def held(worker):
        ps = dict(worker.model_runner.model.named_parameters())
        return {"rank": worker.rank, "embed": list(ps["model.embed_tokens.weight"].shape),
                "qkv": list(ps["model.layers.0.self_attn.qkv_proj.weight"].shape)}

    print("RESULT " + json.dumps({"start_s": start, "generate_s": gens, "workers": llm.collective_rpc(held),
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import append_results, table
    from hyperrl.models.tiny import tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        tiny_qwen3(64, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256,
                   seed=0).save_pretrained(tmp)
        res = {}
        for tp in (1, 2):
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                   **({"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))} if tp > 1 else {})}
            r = subprocess.run([sys.executable, __file__, "--child", str(tp), tmp], env=env, capture_output=True,
                               text=True, timeout=900)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"tp={tp} failed:\n{r.stderr[-3000:]}")
            res[tp] = json.loads(line[len("RESULT "):])
    rows = [[tp, f"{r['start_s']:.1f}", " ".join(f"{g:.2f}" for g in r["generate_s"]),
             f"{r['generate_s'][1] / res[1]['generate_s'][1]:.1f}", r["tokens"] == res[1]["tokens"],
             "; ".join(f"rank {w['rank']}: embed {w['embed']}, qkv {w['qkv']}" for w in r["workers"])]
            for tp, r in res.items()]
    append_results("vLLM CPU: tensor parallelism inside one engine (TP 2 vs TP 1)",
                   "Tiny random Qwen3 (vocab 64, hidden 128, 4 heads / 2 kv heads), fp32, enforce_eager, 4 prompts "
                   "× 8 greedy tokens, each engine in its own process:\n\n"
                   + table(["tp", "start s", "generate s (1st, 2nd)", "2nd generate / TP 1's", "tokens = TP 1's",
                            "what each worker holds"], rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), sys.argv[3])
    else:
        main()
