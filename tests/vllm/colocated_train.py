"""Run under ``torchrun --nproc-per-node 2`` (one engine) or ``4`` (two engine replicas in one process group) in
.venv-vllm (by check_vllm_colocated.py): the default task trained by a TP 2 trainer (FSDP2 × TP) whose ranks each
host one worker of a vLLM TP 2 engine (vLLM's external launcher, in process); extra arguments are config overrides.
Every publication is the trainer's direct plan into vLLM's layout and is checked on each rank (``verify``); prints
one ``RESULT`` line per rank, with the plan's bytes and — for comparison — those of the same plan with and without
the fan-out tree."""

import json
import os
import sys
import tempfile


def _bytes(plan) -> dict:
    st = plan.stats()
    return {"wire": st.wire_bytes, "max_out": st.max_out, "forwards": st.forward_bytes, "fan_out": bool(plan.fan_out)}


def main(steps: int, extra: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.distributed.dims import init_distributed
    from hyperrl.sharding import reshard_plan

    init_distributed("cpu")
    out = os.environ.get("HYPERRL_OUT") or tempfile.mkdtemp()
    cfg = load_config(None, ["--run.tp=2", "--rollout.engine={name: vllm, tp: 2, colocated: true, verify: true, "
                             "enforce_eager: true}", f"--run.out_dir={out}", f"--run.steps={steps}",
                             "--run.eval_every=0", *extra])
    tr = build_trainer(cfg)
    metrics = [tr.step() for _ in range(cfg.run.steps)]
    rank = dist.get_rank()
    full = {k: p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
            for k, p in tr.policy.named_parameters()}
    plan = tr.publisher.publisher.plan
    res = {"rank": rank, "task": cfg.task.name, "versions": [m["policy_version"] for m in metrics],
           "served": tr.engine.policy_version, "rewards": [m["reward_mean"] for m in metrics],
           "mismatch_max": max(m["mismatch_max_abs"] for m in metrics),
           "equal_trainer": tr.engine.verify_workers(full) is True,
           "received": tr.engine.last_received[0],
           "plan_in": sum(t.nbytes for t in plan if t.dst_rank == rank),
           "model_bytes": sum(v.numel() * v.element_size() for v in full.values()),
           "engine_tp": tr.engine.tp, "colocated": tr.engine.colocated,
           "placements": sorted({str(p.placements) for p in tr.policy.parameters() if hasattr(p, "placements")}),
           "world": dist.get_world_size(), "fan_out": cfg.rollout.fan_out,
           "plan": _bytes(plan),
           "plan_other": _bytes(reshard_plan(plan.src, plan.dst, fan_out=not cfg.rollout.fan_out))}
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")  # one write: the ranks share the pipe (no line split)
    sys.stdout.flush()
    dist.barrier()
    del torch


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30, sys.argv[2:])
