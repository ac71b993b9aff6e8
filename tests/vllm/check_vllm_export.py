"""vLLM loads hyperrl's export, run by tests/rollout/test_vllm.py in .venv-vllm.

Trains the default task for a few steps with the transformers engine, exports the final checkpoint
(``hyperrl.export.export_hf``: save_pretrained + the character tokenizer), starts ``vllm.LLM`` on
that directory *with* its tokenizer, and prints one JSON line: vLLM's sampled-token log-probs
against the trained policy's forward (the export holds the trained weights), and the tokenizer's
round trip through vLLM.
"""

import json
import sys
import tempfile
from pathlib import Path


def run() -> dict:
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.export import export_hf
    from hyperrl.loop.forward import plain_logprobs_and_entropy
    from hyperrl.trajectory import stack_episodes

    out = Path(tempfile.mkdtemp())
    cfg = load_config(None, [f"--run.out_dir={out}", "--run.eval_every=0", "--run.threads=1"])
    tr = build_trainer(cfg)
    for _ in range(20):
        tr.step()
    hf = export_hf(tr.save(), out / "hf")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(hf), dtype="float32", seed=0, max_model_len=128, logprobs_mode="processed_logprobs",
              enforce_eager=True)
    prompts = [tr.task.encode(s) for s in tr.task.held_out(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=2, max_tokens=4, logprobs=0, temperature=1.0, seed=1), use_tqdm=False)
    rows = []
    for p, o in zip(prompts, outs):
        for c in o.outputs:
            ids = list(c.token_ids)
            rows.append(dict(tokens=p + ids, action=[False] * len(p) + [True] * len(ids),
                             logprobs=[0.0] * len(p) + [float(s[t].logprob) for t, s in zip(ids, c.logprobs)],
                             reward=0.0, group_id=0, version=0))
    b = stack_episodes(rows, 0)
    with torch.no_grad():
        lp, _ = plain_logprobs_and_entropy(tr.policy, b, 1.0)
    text = llm.get_tokenizer().decode(prompts[0], skip_special_tokens=True)
    res = {"diff": float((lp - b["rollout_logprobs"])[b["action_mask"]].abs().max()),
           "decoded_prompt": text, "expected_prompt": tr.task.held_out(1)[0].prompt}
    llm.llm_engine.engine_core.shutdown()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
