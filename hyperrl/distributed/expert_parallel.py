"""Expert parallelism for a mixture of experts: each rank of an ``ep`` group holds ``E / ep`` of a
layer's experts and runs them on the tokens routed to them from every rank of the group.

:class:`ExpertParallelExperts` replaces a transformers stacked-experts module (Qwen3-MoE's
``mlp.experts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, called as
``experts(hidden [N, H], top_k_index [N, k], top_k_weights [N, k])``) with its local slice
``[lo, lo + E/ep)`` (linear placement: rank ``r`` of the group holds experts ``r·E/ep …``). Its
forward, for the ``N·k`` (token, slot) pairs of this rank:

1. **dispatch** — pairs sorted by the rank holding their expert; counts exchanged, then the pairs'
   hidden states and local expert ids with ``all_to_all_single`` (the hidden states through the
   functional collectives' ``all_to_all_single_autograd``: its backward is the reverse exchange, so
   gradients flow back to the sending rank's tokens);
2. **compute** — every received pair through its local expert (SwiGLU: ``down(act(gate) · up)``);
3. **combine** — results exchanged back (the reverse all-to-all), weighted by the pair's gate weight and
   summed into its token.

Gradients: a local expert's gradient is the sum over every rank of the group's tokens routed to it
(the backward all-to-all carries them home); ranks holding the same experts in different ``ep``
groups (the data-parallel replicas of an expert shard) sum theirs with :func:`sync_expert_grads`.
Written here (not a library's) because torch has no MoE dispatch of its own; the all-to-all, the
autograd function and process groups are torch.distributed's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["ExpertParallelExperts", "expert_groups", "shard_experts", "expert_params", "sync_expert_grads"]


def expert_groups(world: int, ep: int):
    """``(ep group, replica group, ep rank)`` of this rank: ``ep`` consecutive ranks share a layer's
    experts (an ``ep`` group); ranks at the same position of different groups hold the same experts
    (a replica group, ``world / ep`` ranks). Every rank must call this (``new_group`` is collective)."""
    if ep < 1 or world % ep:
        raise ValueError(f"run.ep={ep}: must divide the world size {world}")
    rank = dist.get_rank()
    ep_group = replica_group = None
    for g in range(world // ep):
        ranks = list(range(g * ep, (g + 1) * ep))
        pg = dist.new_group(ranks)
        if rank in ranks:
            ep_group = pg
    for j in range(ep):
        ranks = list(range(j, world, ep))
        pg = dist.new_group(ranks)
        if rank in ranks:
            replica_group = pg
    return ep_group, replica_group, rank % ep


class ExpertParallelExperts(torch.nn.Module):
    """A stacked-experts module's local slice over an ``ep`` group (see the module doc).
    ``ExpertParallelExperts.comm_seconds`` accumulates the wall time of the forward's exchanges (counts,
    dispatch, combine; the backward's mirror exchange is not timed) over every instance — a benchmark's
    all-to-all share."""

    comm_seconds = 0.0

    def __init__(self, experts: torch.nn.Module, group, ep_rank: int, ep: int, mesh=None):
        super().__init__()
        E = int(experts.num_experts)
        if E % ep:
            raise ValueError(f"run.ep={ep}: must divide the experts per layer ({E})")
        self.num_experts, self.ep, self.ep_rank, self.group = E, ep, ep_rank, group
        self.local = E // ep
        lo = ep_rank * self.local
        gate_up = experts.gate_up_proj.detach()[lo:lo + self.local].clone()
        down = experts.down_proj.detach()[lo:lo + self.local].clone()
        if mesh is not None:  # DTensors on the ("replica", "ep"[, "tp"]) mesh: checkpoints and publication read it
            from torch.distributed.tensor import DTensor, Replicate, Shard

            placements = [Replicate(), Shard(0)] + [Replicate()] * (mesh.ndim - 2)
            gate_up, down = (DTensor.from_local(t, mesh, placements, run_check=False) for t in (gate_up, down))
        self.gate_up_proj = torch.nn.Parameter(gate_up)
        self.down_proj = torch.nn.Parameter(down)
        self.act_fn = experts.act_fn
        self.first = lo

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H]``, ``top_k_index [N, k]`` (global expert ids), ``top_k_weights [N, k]`` →
        ``[N, H]``: ``Σ_slot w · expert(hidden)`` with the experts wherever they live."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a
        from torch.distributed._functional_collectives import wait_tensor

        N, k = top_k_index.shape
        if bool((top_k_index < 0).any()) or bool((top_k_index >= self.num_experts).any()):
            raise ValueError(f"expert ids outside 0…{self.num_experts - 1}")
        ids = top_k_index.reshape(-1)
        token = torch.arange(N, device=ids.device).repeat_interleave(k)
        dest = ids // self.local
        order = torch.argsort(dest, stable=True)  # pairs grouped by the rank holding their expert
        send = torch.bincount(dest, minlength=self.ep)
        recv = torch.empty_like(send)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        x = hidden[token[order]]
        x_in = wait_tensor(a2a(x.contiguous(), recv_l, send_l, self.group))
        e_in = torch.empty(sum(recv_l), dtype=ids.dtype, device=ids.device)
        dist.all_to_all_single(e_in, (ids[order] - dest[order] * self.local).contiguous(), recv_l, send_l,
                               group=self.group)
        ExpertParallelExperts.comm_seconds += time.perf_counter() - t0
        # x_in · 0, not zeros: a rank none of whose experts got a token must still join both exchanges'
        # backward (a collective), so its y must depend on x_in
        y = x_in * 0.0
        gate_up_w, down_w = _local(self.gate_up_proj), _local(self.down_proj)
        for e in range(self.local):
            rows = (e_in == e).nonzero()[:, 0]
            if not len(rows):
                continue
            gate, up = torch.nn.functional.linear(x_in[rows], gate_up_w[e]).chunk(2, dim=-1)
            y = y.index_add(0, rows, torch.nn.functional.linear(self.act_fn(gate) * up, down_w[e]))
        t0 = time.perf_counter()
        back = wait_tensor(a2a(y, send_l, recv_l, self.group))
        ExpertParallelExperts.comm_seconds += time.perf_counter() - t0
        w = top_k_weights.reshape(-1)[order].to(back.dtype)
        return hidden.new_zeros(hidden.shape).index_add(0, token[order], (back * w[:, None]).to(hidden.dtype))


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (differentiable), a plain tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def shard_experts(model: torch.nn.Module, group, ep_rank: int, ep: int, mesh=None) -> list[ExpertParallelExperts]:
    """Replace every sparse layer's ``mlp.experts`` (stacked experts) of ``model`` by its
    :class:`ExpertParallelExperts` slice, in place; returns the new modules. ``mesh``: the
    ``("replica", "ep"[, "tp"])`` device mesh — the slices become DTensors on it (``Shard(0)`` over ``ep``,
    replicated over the rest)."""
    out = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            continue
        mlp.experts = ExpertParallelExperts(experts, group, ep_rank, ep, mesh)
        out.append(mlp.experts)
    if not out:
        raise ValueError("run.ep > 1: the model has no stacked-experts layer (mlp.experts.gate_up_proj)")
    return out


def expert_params(modules: list[ExpertParallelExperts]) -> list[torch.nn.Parameter]:
    """The local experts' parameters of ``modules``."""
    return [p for m in modules for p in (m.gate_up_proj, m.down_proj)]


@torch.no_grad()
def sync_expert_grads(params, replica_group, scale: float = 1.0) -> None:
    """Sum each local expert's gradient over its replicas (the ranks holding the same experts), times
    ``scale`` (the trainer's ``1 / loss_scale``), in one coalesced all-reduce; a parameter without a
    gradient joins with zeros."""
    params = list(params)
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(_local(p.grad))
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if replica_group is not None and dist.get_world_size(replica_group) > 1:
        dist.all_reduce(flat, group=replica_group)
    flat *= scale
    for g, v in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(v.view_as(g))
