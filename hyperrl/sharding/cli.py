"""``hyperrl plan``: plan a weight publication for a model and print its statistics."""

from __future__ import annotations

import json
import math
import time

import torch

from hyperrl.sharding.models import MODELS, from_hf_config, parse_parallel, trainer_layout
from hyperrl.sharding.plan import reshard_plan
from hyperrl.sharding.timing import parse_links, predict
from hyperrl.sharding.vllm import rollout_layout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_RANKS = 16384  # per side: the planner's work grows with ranks × tensors; beyond this it runs for minutes


def add_parser(sub) -> None:
    """Add the ``plan`` subcommand and its options to ``sub`` (an argparse subparsers object)."""
    p = sub.add_parser("plan", help="plan trainer -> rollout weight resharding and print its statistics")
    p.add_argument("--model", required=True,
                   help=f"one of {', '.join(sorted(MODELS))}, or an HF config.json (or the directory holding it)")
    p.add_argument("--trainer", default="fsdp=8", help="trainer parallelism, e.g. fsdp=64,ep=16 (axes fsdp, tp, ep)")
    p.add_argument("--rollout", default="tp=8", help="rollout parallelism, e.g. tp=8,dp=32[,ep=256] (axes tp, dp, ep)")
    p.add_argument("--expert-placement", default="linear", choices=["linear", "round_robin"])
    p.add_argument("--vision-dp", action="store_true", help="a vision-language model's tower whole on every rollout "
                   "rank (vLLM's mm_encoder_tp_mode=data) instead of tensor-parallel")
    p.add_argument("--colocated", action="store_true", help="rollout ranks overlap the trainer's (default: disjoint)")
    p.add_argument("--fan-out", nargs="?", const="on", default="off", choices=["on", "off", "auto"],
                   help="destination replicas forward among themselves (auto: whichever the time model finds faster; "
                        "needs --bandwidth)")
    p.add_argument("--bandwidth", help="per-rank link bandwidths for the time model, e.g. intra=400GB/s,inter=50GB/s")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node for the time model (default 8)")
    p.add_argument("--latency", default="0", help="per-message latency for the time model, e.g. 5us (default 0)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--compare", choices=["vllm-m2n"], help="also the bytes each rollout rank receives from vLLM "
                   "0.32's own many-to-many resharder (nccl_m2n: fused and stacked tensors whole to every rank)")


def _check_axes(kind: str, got: dict, allowed: set) -> None:
    bad = sorted(set(got) - allowed)
    if bad:
        raise SystemExit(f"--{kind}: unknown axis {bad[0]!r}; allowed axes are {sorted(allowed)}")


def run(args) -> int:
    """Run ``hyperrl plan``: build the trainer and rollout layouts, plan the publication and print its
    statistics (and the predicted time with ``--bandwidth``); returns 0, bad arguments exit with a message."""
    try:
        tr, ro = parse_parallel(args.trainer), parse_parallel(args.rollout)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    _check_axes("trainer", tr, {"fsdp", "tp", "ep"})
    _check_axes("rollout", ro, {"tp", "dp", "ep"})
    for kind, axes in (("trainer", tr), ("rollout", ro)):
        ranks = math.prod(axes.values())
        if ranks > MAX_RANKS:
            raise SystemExit(f"error: --{kind} {args.trainer if kind == 'trainer' else args.rollout}: {ranks:,} "
                             f"ranks; the planner enumerates every rank's slices and plans at most {MAX_RANKS:,} "
                             "(the largest deployments today use a few thousand)")
    dtype = DTYPES[args.dtype]
    try:
        cfg = MODELS[args.model] if args.model in MODELS else from_hf_config(args.model)
    except ValueError as e:
        raise SystemExit(f"error: --model: {e}") from None
    t0 = time.perf_counter()
    try:
        src = trainer_layout(cfg, fsdp=tr.get("fsdp", 1), tp=tr.get("tp", 1), ep=tr.get("ep", 1), dtype=dtype)
        offset = 0 if args.colocated else len(src.ranks())
        dst = rollout_layout(cfg, tp=ro.get("tp", 1), dp=ro.get("dp", 1), ep=ro.get("ep", 1),
                             expert_placement=args.expert_placement, dtype=dtype, offset=offset,
                             vision_dp=args.vision_dp)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    links = None
    if args.bandwidth:
        try:
            links = parse_links(args.bandwidth, ranks_per_node=args.gpus_per_node, latency=args.latency)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    elif args.fan_out == "auto":
        raise SystemExit("error: --fan-out auto compares predicted times: give --bandwidth intra=…,inter=…")
    fan_out = {"on": True, "off": False, "auto": "auto"}[args.fan_out]
    t1 = time.perf_counter()
    plan = reshard_plan(src, dst, fan_out=fan_out, links=links)
    t2 = time.perf_counter()
    stats = plan.stats()
    t3 = time.perf_counter()
    info = {"model": cfg.name, "trainer": tr, "rollout": ro, "source_tensors": len(src), "destination_params": len(dst),
            "trainer_ranks": len(src.ranks()), "rollout_ranks": len(dst.ranks()), "groups": len(plan.groups),
            "layout_s": round(t1 - t0, 3), "plan_s": round(t2 - t1, 3), "stats_s": round(t3 - t2, 3),
            "fan_out": plan.fan_out, **stats._asdict()}
    if links is not None:
        pred = predict(plan, links)
        info |= {"predicted_s": pred.seconds, "predicted_phase_s": list(pred.phase_seconds),
                 "slowest_rank": pred.slowest_rank}
    if args.compare == "vllm-m2n":
        from hyperrl.sharding.m2n import m2n_received_bytes

        m2n = m2n_received_bytes(cfg, tp=ro.get("tp", 1), dtype=dtype)
        info |= {"m2n_in_per_rank": m2n.per_rank, "m2n_fallback_bytes": m2n.fallback,
                 "m2n_fallback_tensors": m2n.fallback_tensors, "hyperrl_over_m2n": stats.max_in / max(m2n.per_rank, 1)}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{cfg.name}: trainer {args.trainer} ({info['trainer_ranks']} ranks) -> rollout {args.rollout} "
              f"({info['rollout_ranks']} ranks), {len(src):,} tensors -> {len(dst):,} params, fan_out={plan.fan_out}")
        print(f"planned in {t2 - t1:.2f} s ({len(plan.groups)} geometry groups; layouts {t1 - t0:.2f} s)")
        print(stats.table())
        if links is not None:
            print(pred)
        if args.compare == "vllm-m2n":
            gib = 2**30
            print(f"vLLM nccl_m2n: {m2n.per_rank / gib:.3f} GiB to every rollout rank ({m2n.fallback_tensors:,} of "
                  f"{m2n.tensors:,} tensors whole: {m2n.fallback / gib:.3f} GiB); hyperrl's busiest rank "
                  f"{stats.max_in / gib:.3f} GiB = {info['hyperrl_over_m2n']:.3f} × m2n")
    return 0
