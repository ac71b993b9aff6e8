"""Resharding benchmark, side by side in one run (appended to benchmarks/RESULTS.md).

1. Plan time for Qwen3-4B, Qwen3-30B-A3B and DeepSeek-V3 at trainer 64 / 256 / 1,024 ranks →
   rollout TP8 × DP (a quarter as many ranks), with bytes vs the minimum vs full-gather.
2. The same box overlaps through torch DCP's ``create_read_items_for_chunk_list`` (the peer):
   one [8192, 8192] tensor, 256 row shards → 16 × 16 tiles (256 × 256 ranks), per-rank calls.
3. Execution on 4 gloo processes, Qwen3-0.6B shape in bf16, FSDP4 → TP2 × DP2 (colocated):
   direct (bucketed P2P of the intersections) vs full-gather + send whole tensors + slice.

    python benchmarks/reshard.py            # full
    python benchmarks/reshard.py --quick    # small sizes, no RESULTS.md entry
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402
from hyperrl.sharding import Layout, Mesh, Placement, Spec, plain_destination, reshard_plan  # noqa: E402
from hyperrl.sharding.models import MODELS, trainer_layout  # noqa: E402
from hyperrl.sharding.vllm import rollout_layout  # noqa: E402

GIB = 2**30


def _trainer(model: str, n: int) -> dict:
    if model == "qwen3-4b":
        return dict(fsdp=n)
    if model == "qwen3-30b-a3b":
        return dict(fsdp=n // 8, ep=8)
    return dict(fsdp=n // 16, ep=16)


def bench_plans(sizes):
    rows = []
    for model in ("qwen3-4b", "qwen3-30b-a3b", "deepseek-v3"):
        cfg = MODELS[model]
        for n in sizes:
            tr = _trainer(model, n)
            src = trainer_layout(cfg, **tr)
            ro = dict(tp=8, dp=max(n // 32, 1))
            dst = rollout_layout(cfg, offset=n, **ro)
            for fan_out in (False, True):
                t0 = time.perf_counter()
                plan = reshard_plan(src, dst, fan_out=fan_out)
                t1 = time.perf_counter()
                s = plan.stats()
                rows.append([model, n, f"tp8 x dp{ro['dp']}", fan_out, round(t1 - t0, 3), f"{len(plan):,}",
                             round(s.wire_bytes / GIB, 1), round(s.wire_bytes / s.recv_min_bytes, 3),
                             round(s.egress_bytes / GIB, 1), round(s.egress_bytes / max(s.src_min_bytes, 1), 3),
                             round(s.max_out / GIB, 1), round(s.max_out / max(s.max_out_bound, 1), 3),
                             round(s.full_gather_bytes / GIB, 1), round(s.full_gather_bytes / s.wire_bytes, 2)])
    return table(["model", "trainer ranks", "rollout", "fan-out", "plan s", "transfers", "wire GiB",
                  "wire/B_recv_min", "egress GiB", "egress/B_src_min", "max out/rank GiB", "max out/bound",
                  "full-gather GiB", "full-gather/wire"], rows)


def bench_dcp(n_src=256, side=16, dim=8192, repeat=5):
    """Median of ``repeat`` runs each, planner caches cleared before every hyperrl run (cold)."""
    import statistics

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from hyperrl.sharding import boxes, layout, spec

    def build():
        src = Layout({"w": Placement((dim, dim), torch.bfloat16, Spec.shard(2, d0="fsdp"), Mesh.of(fsdp=n_src))})
        dst = plain_destination({"w": ((dim, dim), torch.bfloat16, Spec.shard(2, d0="a", d1="b"))},
                                Mesh.of(a=side, b=side, offset=n_src))
        return src, dst

    t_warm = []
    for _ in range(repeat):  # warm: the layout-level caches persist, as when a trainer republishes each step
        src, dst = build()
        t0 = time.perf_counter()
        reshard_plan(src, dst)
        t_warm.append(time.perf_counter() - t0)
    t_plan, t_all = [], []
    for _ in range(repeat):
        spec.dim_intervals.cache_clear()
        layout._rule_boxes.cache_clear()
        src, dst = build()
        t0 = time.perf_counter()
        plan = reshard_plan(src, dst)
        t1 = time.perf_counter()
        ours = plan.transfers()
        t2 = time.perf_counter()
        t_plan.append(t1 - t0)
        t_all.append(t2 - t0)
    saved = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
             for b in boxes(src["w"].spec, src["w"].mesh, (dim, dim)).values()]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size((dim, dim)), saved)
    tiles = boxes(Spec.shard(2, d0="a", d1="b"), Mesh.of(a=side, b=side), (dim, dim))
    local = [[ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))] for b in tiles.values()]
    t_dcp = []
    for _ in range(repeat):
        t3 = time.perf_counter()
        reads = [r for chunks in local for r in create_read_items_for_chunk_list("w", md, chunks)]
        t_dcp.append(time.perf_counter() - t3)
    elems = sum(int(torch.Size(r.lengths).numel()) for r in reads)
    assert len(reads) == len(ours) and elems == dim * dim, (len(reads), len(ours), elems)
    tp, ta, td, tw = (statistics.median(x) for x in (t_plan, t_all, t_dcp, t_warm))
    rows = [[f"[{dim}, {dim}] {n_src} rows -> {side}x{side} tiles", len(ours), round(tp * 1e3, 2), round(tw * 1e3, 2),
             round(ta * 1e3, 2), round(td * 1e3, 2), round(td / tp, 1), round(td / tw, 1), round(td / ta, 1)]]
    return table(["case", "overlaps", "hyperrl plan ms (cold)", "plan ms (warm layout caches)",
                  "plan+materialise ms (cold)", "DCP helper ms", "DCP/plan cold", "DCP/plan warm",
                  "DCP/(plan+materialise)"], rows)


def _exec_worker(rank, world, model, executor, cap, trainer=None):
    from hyperrl.sharding.execute import execute_direct, execute_full_gather
    from hyperrl.sharding.simulate import _alloc

    cfg = MODELS[model]
    src = trainer_layout(cfg, **(trainer or dict(fsdp=4)))
    dst = rollout_layout(cfg, tp=2, dp=2)
    g = torch.Generator().manual_seed(rank)
    from hyperrl.sharding import boxes

    mine = {n: torch.randn(boxes(pl.spec, pl.mesh, pl.shape)[rank].sizes, generator=g).to(pl.dtype)
            for n, pl in src.items()}
    out = _alloc(dst).get(rank, {})
    plan = reshard_plan(src, dst) if executor == "direct" else None
    if plan is not None:
        plan.buckets(cap)  # computed once per plan: a trainer republishes the same plan every version
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    if executor == "direct":
        c = execute_direct(plan, rank, mine, out, max_bytes=cap)
    else:
        c = execute_full_gather(src, dst, rank, mine, out, max_bytes=cap)
    dist.barrier()
    return time.perf_counter() - t0, c


def bench_exec(model="qwen3-0.6b", cap=128 << 20, repeat=2):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_helpers import run_gloo

    rows = []
    for label, trainer in (("FSDP4", dict(fsdp=4)), ("FSDP2 x TP2", dict(fsdp=2, tp=2))):
        times = {}
        for executor in ("direct", "full_gather", "direct", "full_gather")[: 2 * repeat]:
            res = run_gloo(_exec_worker, 4, model, executor, cap, trainer, timeout=900)
            t = max(r[0] for r in res.values())
            moved = sum(r[1]["received"] for r in res.values())
            times.setdefault(executor, []).append(t)
            rows.append([f"{label} -> TP2xDP2, {executor}", round(t, 2), round(moved / GIB, 3)])
        ratio = min(times["full_gather"]) / min(times["direct"])
        rows.append([f"{label}: full_gather / direct (best of each)", round(ratio, 2), ""])
    return table(["case (4 gloo procs, colocated, bf16, 128 MiB buckets)", "s", "GiB received"], rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.quick:
        print(bench_plans([64]))
        print(bench_dcp(64, 8, 1024))
        print(bench_exec("qwen3-tiny", cap=4096, repeat=1))
        return
    plans = bench_plans([64, 256, 1024])
    dcp = bench_dcp()
    ex = bench_exec()
    append_results("reshard", "Plan time and bytes (one core):\n\n" + plans + "\n\nSame box overlaps vs torch DCP "
                   "`create_read_items_for_chunk_list`:\n\n" + dcp + "\n\nExecution:\n\n" + ex)


if __name__ == "__main__":
    main()
