"""vLLM stops where the exported model's stop ids say, run by tests/rollout/test_vllm.py in .venv-vllm.

A Qwen-style checkpoint with two stop ids (``generation_config.eos_token_id = [<|im_end|>,
<|endoftext|>]``, the tokenizer's EOS only the first) whose final norm is zero, so every logit is 0
and greedy decoding emits token 0 = ``<|endoftext|>``. A LoRA run (the norm is not an adapter: it
stays 0) is exported merged and as adapters alone; vLLM serves both. Greedy generation stops after
that one token because the export carries both stop ids — with ``ignore_eos`` (vLLM then adds no
generation-config stop ids) the same model runs to ``max_tokens``.
"""

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run() -> dict:
    sys.path.insert(0, str(ROOT))
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.export import export_hf
    from tests.hf_fixtures import qwen3_checkpoint

    tmp = Path(tempfile.mkdtemp())
    ck = qwen3_checkpoint(tmp / "src", two_stops=True, zero_norm=True)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "answer": str(a + 1)} for a in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp / "train.parquet")
    cfg = load_config(None, [f"--model.checkpoint={ck}", f"--data.train_files=[{tmp / 'train.parquet'}]",
                             "--model.lora={r: 4, alpha: 8}", "--rollout.prompts_per_step=2", "--rollout.n=2",
                             "--rollout.max_new_tokens=4", "--run.eval_every=0", f"--run.out_dir={tmp / 'run'}",
                             "--run.threads=1"])
    tr = build_trainer(cfg)
    tr.step()
    step = tr.save()
    merged, adapters = export_hf(step, tmp / "merged"), export_hf(step, tmp / "adapters", adapters=True)
    prompt = tr.task.encode(tr.task.dataset[0])

    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    res = {"generation_config": json.loads((merged / "generation_config.json").read_text())["eos_token_id"]}
    llm = LLM(model=str(merged), dtype="float32", seed=0, max_model_len=128, enforce_eager=True)
    for key, sp in (("merged", SamplingParams(temperature=0, max_tokens=8)),
                    ("merged_ignore_eos", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))):
        c = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
        res[key] = {"tokens": list(c.token_ids), "finish_reason": c.finish_reason}
    llm.llm_engine.engine_core.shutdown()
    del llm
    llm = LLM(model=str(ck), dtype="float32", seed=0, max_model_len=128, enforce_eager=True, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    c = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0, max_tokens=8),
                     lora_request=LoRARequest("exported", 1, str(adapters)), use_tqdm=False)[0].outputs[0]
    res["adapters"] = {"tokens": list(c.token_ids), "finish_reason": c.finish_reason}
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
