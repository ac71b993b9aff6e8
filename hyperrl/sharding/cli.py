"""``hyperrl plan``: plan a weight publication for a model and print its statistics."""

from __future__ import annotations

import json
import time

import torch

from .models import MODELS, parse_parallel, rollout_layout, trainer_layout
from .plan import reshard_plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan trainer -> rollout weight resharding and print its statistics")
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--trainer", default="fsdp=8", help="trainer parallelism, e.g. fsdp=64,ep=16 (axes fsdp, tp, ep)")
    p.add_argument("--rollout", default="tp=8", help="rollout parallelism, e.g. tp=8,dp=32[,ep=256] (axes tp, dp, ep)")
    p.add_argument("--expert-placement", default="linear", choices=["linear", "round_robin"])
    p.add_argument("--colocated", action="store_true", help="rollout ranks overlap the trainer's (default: disjoint)")
    p.add_argument("--fan-out", action="store_true", help="destination replicas forward among themselves")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _check_axes(kind: str, got: dict, allowed: set) -> None:
    bad = sorted(set(got) - allowed)
    if bad:
        raise SystemExit(f"--{kind}: unknown axis {bad[0]!r}; allowed axes are {sorted(allowed)}")


def run(args) -> int:
    try:
        tr, ro = parse_parallel(args.trainer), parse_parallel(args.rollout)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    _check_axes("trainer", tr, {"fsdp", "tp", "ep"})
    _check_axes("rollout", ro, {"tp", "dp", "ep"})
    cfg, dtype = MODELS[args.model], DTYPES[args.dtype]
    t0 = time.perf_counter()
    try:
        src = trainer_layout(cfg, fsdp=tr.get("fsdp", 1), tp=tr.get("tp", 1), ep=tr.get("ep", 1), dtype=dtype)
        offset = 0 if args.colocated else len(src.ranks())
        dst = rollout_layout(cfg, tp=ro.get("tp", 1), dp=ro.get("dp", 1), ep=ro.get("ep", 1),
                             expert_placement=args.expert_placement, dtype=dtype, offset=offset)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    t1 = time.perf_counter()
    plan = reshard_plan(src, dst, fan_out=args.fan_out)
    t2 = time.perf_counter()
    stats = plan.stats()
    t3 = time.perf_counter()
    info = {"model": cfg.name, "trainer": tr, "rollout": ro, "source_tensors": len(src), "destination_params": len(dst),
            "trainer_ranks": len(src.ranks()), "rollout_ranks": len(dst.ranks()), "groups": len(plan.groups),
            "layout_s": round(t1 - t0, 3), "plan_s": round(t2 - t1, 3), "stats_s": round(t3 - t2, 3),
            **stats._asdict()}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{cfg.name}: trainer {args.trainer} ({info['trainer_ranks']} ranks) -> rollout {args.rollout} "
              f"({info['rollout_ranks']} ranks), {len(src):,} tensors -> {len(dst):,} params, fan_out={args.fan_out}")
        print(f"planned in {t2 - t1:.2f} s ({len(plan.groups)} geometry groups; layouts {t1 - t0:.2f} s)")
        print(stats.table())
    return 0
