"""The publication time model against measured executions on 4 gloo processes (one machine).

Calibration (all 4 ranks at once, as in a publication): per-rank bandwidth from a ring exchange
of 32 MiB per rank (each rank sends to r+1 and receives from r−1), per-message latency from a
ring of 512 small messages per rank in one batch, local-copy bandwidth from a 32 MiB copy and the
fixed cost of a copy from 512 tiny ones. gloo over loopback on 2 cores is CPU-bound, so a rank's
sends and receives share it: the model runs half duplex (``duplex=False``). Then for each layout:
``predict(plan, Links(bw, bw, latency, ranks_per_node=4, local=…, copy_latency=…, duplex=False))``
against the median wall time of ``execute_direct`` (barrier to barrier, 5 runs), and the error.

    .venv/bin/python benchmarks/timemodel.py

Appends the table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402

WORLD = 4
LAYOUTS = [  # (name, trainer axes, trainer offset, rollout axes, rollout offset, fan-out)
    ("fsdp4 → tp2×dp2, colocated", dict(fsdp=4), 0, dict(tp=2, dp=2), 0, False),
    ("fsdp4 → tp4, colocated", dict(fsdp=4), 0, dict(tp=4), 0, False),
    ("fsdp2×tp2 → tp2×dp2, colocated", dict(fsdp=2, tp=2), 0, dict(tp=2, dp=2), 0, False),
    ("fsdp2 → tp2, disjoint", dict(fsdp=2), 0, dict(tp=2), 2, False),
    ("fsdp2 → dp2, disjoint", dict(fsdp=2), 0, dict(tp=1, dp=2), 2, False),
    ("fsdp2 → dp2, disjoint, fan-out", dict(fsdp=2), 0, dict(tp=1, dp=2), 2, True),
]


def _model():
    from hyperrl.sharding.models import ModelShape

    return ModelShape("bench-qwen3", hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, intermediate=1536,
                       vocab=8192, tied=False)


def _timed(fn, dist, repeat=5):
    out = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _calibrate(rank, dist):
    nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
    big = torch.ones(8 << 20)  # 32 MiB of fp32
    rbuf = torch.empty_like(big)

    def ring(send, recv):
        ops = [dist.P2POp(dist.isend, s, nxt) for s in send] + [dist.P2POp(dist.irecv, r, prv) for r in recv]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    ring([big], [rbuf])  # warm-up
    t_big = _timed(lambda: ring([big], [rbuf]), dist)
    small = [torch.ones(4) for _ in range(512)]
    rsmall = [torch.empty(4) for _ in range(512)]
    ring(small, rsmall)
    t_small = _timed(lambda: ring(small, rsmall), dist)
    dst = torch.empty_like(big)
    t_copy = _timed(lambda: dst.copy_(big), dist)
    tiny_src, tiny_dst = torch.ones(512, 4), torch.empty(512, 4)

    def copies():
        for i in range(512):
            tiny_dst[i].copy_(tiny_src[i])

    t_copies = _timed(copies, dist)
    # half duplex: in the ring each rank sends and receives 32 MiB, 64 MiB through one rank
    latency = t_small / (2 * 512)
    bw = 2 * big.numel() * 4 / max(t_big - 2 * latency, 1e-9)
    return bw, latency, big.numel() * 4 / t_copy, t_copies / 512


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hyperrl.sharding import reshard_plan
    from hyperrl.sharding.execute import execute_direct
    from hyperrl.sharding.models import trainer_layout
    from hyperrl.sharding.simulate import source_shards
    from hyperrl.sharding.timing import Links, predict
    from hyperrl.sharding.vllm import rollout_layout

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cal = torch.tensor(_calibrate(rank, dist), dtype=torch.float64)
        dist.all_reduce(cal)
        bw, latency, copy_bw, copy_lat = (cal / world).tolist()  # the ranks' mean
        links = Links(bw, bw, latency, ranks_per_node=world, local=copy_bw, copy_latency=copy_lat, duplex=False)
        cfg, rows = _model(), []
        for name, tr, tr_off, ro, ro_off, fan in LAYOUTS:
            src = trainer_layout(cfg, dtype=torch.float32, offset=tr_off, **tr)
            dst = rollout_layout(cfg, dtype=torch.float32, offset=ro_off, **ro)
            plan = reshard_plan(src, dst, fan_out=fan)
            torch.manual_seed(0)
            full = {k: torch.randn(pl.shape) for k, pl in src.items()}
            mine = source_shards(src, full).get(rank, {})
            out = {n: torch.empty(p.local_shape(p.mesh.ranks.index(rank)), dtype=p.dtype)
                   for n, p in dst.params.items() if rank in p.mesh.ranks}
            execute_direct(plan, rank, mine, out)  # warm-up
            measured = _timed(lambda: execute_direct(plan, rank, mine, out), dist)
            s = plan.stats()
            rows.append((name, s.wire_bytes, s.local_bytes, predict(plan, links).seconds, measured))
        if rank == 0:
            queue.put((links, rows))
    finally:
        dist.destroy_process_group()


def main():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, WORLD, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    links, rows = queue.get(timeout=1200)
    for p in procs:
        p.join()
    out = [[name, f"{wire / 2**20:.1f}", f"{local / 2**20:.1f}", pred * 1e3, meas * 1e3, f"{(pred - meas) / meas:+.0%}"]
           for name, wire, local, pred, meas in rows]
    worst = max(abs(p - m) / m for *_, p, m in rows)
    append_results("time model vs gloo", (
        f"Calibrated on 4 gloo processes at once: per-rank bandwidth {links.intra / 1e9:.3g} GB/s (half duplex), "
        f"latency {links.latency * 1e6:.3g} µs per message, local copy {links.local / 1e9:.3g} GB/s + "
        f"{links.copy_latency * 1e6:.3g} µs each. A Qwen3-shaped model "
        f"(hidden 512, 4 layers, vocab 8,192, fp32). Largest error {worst:.0%}.\n\n"
        + table(["layout", "wire MiB", "local MiB", "predicted ms", "measured ms", "error"], out)))


if __name__ == "__main__":
    main()
