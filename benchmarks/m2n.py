"""hyperrl's resharding plan against vLLM 0.32's own many-to-many resharder (``nccl_m2n``), in bytes received
per rollout rank, for the same trainer → engine layouts (issue 33, item 3). vLLM's rule — direct shards for
plain column / row-parallel parameters, the whole tensor to every rank for fused and stacked ones — is read from
``vllm/distributed/weight_transfer/m2n_layout.py`` (:mod:`hyperrl.sharding.m2n`); hyperrl's numbers are its
plan's (``reshard_plan(...).stats()``: the busiest rollout rank's received bytes). Appends the table to
benchmarks/RESULTS.md.

    python benchmarks/m2n.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402

# (model, trainer, rollout, whose published layout)
CASES = [
    ("qwen3-8b", dict(fsdp=8), dict(tp=4, dp=2), "dense, FSDP8 → TP4×DP2"),
    ("qwen3-8b", dict(fsdp=8), dict(tp=8), "dense, FSDP8 → TP8"),
    ("qwen3-4b", dict(fsdp=4), dict(tp=2, dp=2), "HyperParallel-RL: FSDP4 → DP2×TP2"),
    ("qwen3-30b-a3b", dict(fsdp=2, ep=4), dict(tp=2, dp=2, ep=4), "HyperParallel-RL: TP2 / EP4 publication"),
    ("qwen3-30b-a3b", dict(fsdp=2, ep=8), dict(tp=8, dp=2), "NeMo-RL: EP8×PP2 → TP8×DP2 (PP as FSDP)"),
    ("deepseek-v3", dict(fsdp=16, ep=16), dict(tp=32, dp=8), "NeMo-RL: PP16×EP16 → TP32×DP8 (PP as FSDP)"),
    ("deepseek-v3", dict(fsdp=64, ep=16), dict(tp=8, dp=32), "NeMo-RL planner case: FSDP64×EP16 → DP32×TP8"),
]


def main() -> None:
    from hyperrl.sharding import reshard_plan, rollout_layout
    from hyperrl.sharding.m2n import m2n_received_bytes
    from hyperrl.sharding.models import MODELS, trainer_layout

    gib, rows = 2**30, []
    for name, tr, ro, who in CASES:
        cfg = MODELS[name]
        src = trainer_layout(cfg, **tr)
        dst = rollout_layout(cfg, **ro, offset=len(src.ranks()))
        t0 = time.perf_counter()
        stats = reshard_plan(src, dst).stats()
        secs = time.perf_counter() - t0
        m2n = m2n_received_bytes(cfg, tp=ro.get("tp", 1))
        axes = [",".join(f"{k}={v}" for k, v in d.items()) for d in (tr, ro)]
        rows.append([name, who, *axes,
                     round(m2n.per_rank / gib, 3), f"{m2n.fallback_tensors:,} / {m2n.tensors:,}",
                     round(stats.max_in / gib, 3), round(stats.max_in / m2n.per_rank, 3),
                     round(m2n.per_rank * len(dst.ranks()) / gib, 1), round(stats.recv_min_bytes / gib, 1),
                     round(secs, 2)])
    out = table(["model", "layout", "trainer", "rollout", "m2n GiB / rank", "m2n whole tensors",
                 "hyperrl GiB / busiest rank", "hyperrl / m2n", "m2n total GiB", "hyperrl total (B_recv_min) GiB",
                 "plan s"], rows)
    print(out)
    append_results("m2n", "Bytes each rollout rank receives, bf16, non-colocated (every element crosses): vLLM "
                   "0.32 nccl_m2n's rule against hyperrl's plan.\n\n" + out)


if __name__ == "__main__":
    main()
