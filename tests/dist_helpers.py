"""Run a function on N real gloo processes (torch.multiprocessing) and collect results."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, fn(rank, world, *args), None))
    except Exception:  # noqa: BLE001 - report the worker's traceback to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn, world: int, *args, timeout: float = 240.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, out, err = queue.get(timeout=timeout)
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results


def record_grads(tr):
    """The trainer's policy gradients (and a critic's, named ``critic.…``) as its optimizer sees them (after the
    data-parallel sync), as full tensors: filled on each ``clip_grad_norm`` call of ``tr.parallel``."""
    seen, clip = {}, tr.parallel.clip_grad_norm
    names = {id(p): n for n, p in tr.policy.named_parameters()}
    if getattr(tr, "critic", None) is not None:
        names.update({id(p): f"critic.{n}" for n, p in tr.critic.named_parameters()})

    def wrapped(params, max_norm):
        params = list(params)
        for p in params:
            if p.grad is not None and id(p) in names:
                g = p.grad
                seen[names[id(p)]] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        return clip(params, max_norm)

    tr.parallel.clip_grad_norm = wrapped
    return seen
