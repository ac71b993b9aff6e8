"""The parallel strategy: every collective and lockstep rule of the loop — data-parallel, and the TP, CP and EP
rules beside it — in one object, over the process groups of the run's :class:`~hyperrl.distributed.dims.ParallelDims`.

FSDP2 needs every rank to make the same model calls in the same order. The rules that keep
ranks in step — and the reductions that make data-parallel training exact — live here, not in
the loop:

* the **global normaliser**: token / sequence counts of an optimizer step summed over ranks,
  so summed per-micro-batch losses equal the full-batch loss (:mod:`hyperrl.transforms.aggregation`);
* **micro-batch count agreement**: ranks with fewer micro-batches run zero-weight passes;
* **forward-path agreement**: the shared-prefix forward only if every rank prefers it, the
  continuation call if any rank needs it;
* **row agreement**: a step is skipped on every rank when any rank has no rows;
* **loss scale**: FSDP averages gradients over ranks, so each loss is multiplied by the
  data-parallel size to give the sum the global normaliser expects (gloo has no PREMUL_SUM for a
  factor of 1);
* **tensor parallelism** (``tp`` consecutive ranks form a TP group): the ranks of a TP group hold
  one model between them and must see the *same* data, so data is sharded over the ``world / tp``
  data-parallel groups (``data_rank``, ``data_world``) and sums over data (the normaliser,
  evaluation counts) are reduced over the data-parallel group only — summed over every rank they
  would count each row ``tp`` times;
* **context parallelism** (``cp`` consecutive ranks form a CP group): its ranks train the *same* rows, each
  holding a slice of every sequence (:mod:`hyperrl.distributed.context_parallel`); data is sharded over the
  ``world / cp`` groups like TP's, the group's batch is its first rank's (:meth:`TorchParallel.share_batch`),
  and the gathered log-probs' backward (a reduce-scatter *sum* over the ``cp`` identical losses) together with
  FSDP's average over every rank and ``loss_scale = world / cp`` gives the one-process gradient;
* **TP-partial gradients**: parameters replicated over TP but applied to each rank's local heads
  (Qwen3's q/k norms) get their gradients summed over the TP group before clipping;
* **replicated modules** (a LoRA policy's frozen base is not sharded): parameters broadcast from
  rank 0 at setup, plain (non-DTensor) gradients all-reduced before clipping;
* **gradient norm** over sharded (DTensor) gradients — on several device meshes at once under
  TP × FSDP (see :meth:`TorchParallel.clip_grad_norm`); **metric reduction** (mean over the
  ranks that report a key).

:class:`LocalParallel` is the identity (one process); :class:`TorchParallel` runs the
rules on an initialised ``torch.distributed`` process group (gloo, NCCL, HCCL).
"""

from __future__ import annotations

import torch

from hyperrl import transforms as T

__all__ = ["LocalParallel", "TorchParallel", "TorchDataParallel", "make_parallel"]


class LocalParallel:
    """One process: every rule is the identity. ``rank`` / ``world`` are the process's;
    ``data_rank`` / ``data_world`` its data-parallel coordinates (equal without tensor parallelism)."""

    rank, world, tp, cp = 0, 1, 1, 1
    cp_group = None  # the context-parallel process group (cp > 1)

    @property
    def share(self) -> int:
        """How many consecutive ranks train the same rows: a TP or a CP group (``tp · cp``)."""
        return self.tp * self.cp

    @property
    def data_rank(self) -> int:
        return self.rank // self.share

    @property
    def data_world(self) -> int:
        return self.world // self.share

    @property
    def loss_scale(self) -> float:
        return float(self.data_world)

    def shard(self, items: list) -> list:
        """This rank's data-parallel share of a global list (round-robin; a TP group shares one)."""
        return items[self.data_rank::self.data_world]

    def all_have_rows(self, n: int) -> bool:
        return n > 0

    def share_batch(self, batch):
        """The batch every rank of this rank's CP group trains: its first rank's (identity without
        context parallelism)."""
        return batch

    def global_normalizer(self, norm: T.Normalizer) -> T.Normalizer:
        return norm

    def pad_micro_batches(self, micros: list) -> list:
        """``micros`` padded with ``None`` (zero-weight passes) to the largest count over ranks."""
        return micros

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's 1-D ``values`` concatenated in rank order (a batch-global statistic
        that a sum cannot give: M2PO's sorted second moments)."""
        return values

    def agree_forward(self):
        """A function ``(use_shared, S) -> (use_shared, S)`` agreeing the forward path, or None."""
        return None

    def agree_calls(self):
        """A function ``n -> the most model calls any rank makes`` (each rank then makes that many), or None."""
        return None

    def replicate(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with the same parameters and buffers on every rank (rank 0's)."""
        return module

    def sync_grads(self, params) -> None:
        """Reduce the gradients of replicated (non-DTensor) ``params`` over ranks, and sum the
        TP-partial ones (:meth:`sum_over_tp`) over the TP group."""

    def sum_over_tp(self, params) -> None:
        """Mark ``params`` as replicated over TP but with per-rank partial gradients."""
        if params and self.tp == 1:
            raise ValueError("sum_over_tp: no tensor parallelism here")

    def clip_grad_norm(self, params, max_norm: float) -> float:
        """Clip the gradients of ``params`` to a global norm; returns the norm before clipping."""
        gn = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
        return float(gn)

    def mean_metrics(self, metrics: dict) -> dict:
        return metrics

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Numbers summed over ranks (a key some ranks lack counts as 0 there)."""
        return dict(sums)

    def min_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's minimum over every rank (float64: exact for integers below 2⁵³) — an agreement: a flag is 1
        only if it is 1 everywhere."""
        return [float(v) for v in values]

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Each value summed over every rank (float64)."""
        return [float(v) for v in values]

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        return [obj]

    def balance_rows(self, batch, pad_id: int = 0, model=None):
        """``(rows, metrics)``: the step's rows over the data-parallel ranks balanced by their work (``model``: the
        policy, whose width weighs attention against the matmuls) — one process: the batch as it is, no metrics."""
        return batch, {}

    def barrier(self) -> None:
        pass


class TorchParallel(LocalParallel):
    """The rules on the default ``torch.distributed`` process group, split as ``dims`` (a
    :class:`~hyperrl.distributed.dims.ParallelDims` of this world; its rules checked there) says: ``tp > 1``, TP
    groups of ``tp`` consecutive ranks, data reduced over the data-parallel group of this rank (the ranks with its
    TP index); ``cp > 1``: CP groups of ``cp`` consecutive ranks, alike — the groups are the dims'
    (:meth:`~hyperrl.distributed.dims.ParallelDims.data_groups`)."""

    def __init__(self, dims):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world, self.tp, self.cp = dist.get_rank(), dist.get_world_size(), dims.tp, dims.cp
        if dims.world != self.world:
            raise ValueError(f"parallel dims of a world of {dims.world}, in a process group of {self.world}")
        self._tp_partial: list = []
        self._experts: list = []  # expert-parallel parameters and their replica group (experts_over)
        self._replicas = None
        self._dp_group, self._share_group, self._tp_group, self.cp_group = dims.data_groups()

    def experts_over(self, params, replica_group) -> None:
        """Expert-parallel parameters (DTensors on the ``("replica", "ep"[, "tp"])`` mesh): :meth:`sync_grads`
        sums their gradients over ``replica_group`` (the ranks holding the same experts, one TP coordinate)
        ÷ the data-parallel size (each loss carries ``loss_scale``) — the all-to-all's backward already summed
        the tokens of their ``ep`` group; a TP group's ranks computed the same gradient from the same tokens."""
        self._experts, self._replicas = list(params), replica_group

    def sum_over_tp(self, params) -> None:
        if self.tp == 1 and params:
            raise ValueError("sum_over_tp: no tensor parallelism here")
        self._tp_partial = list(params)

    def _reduce(self, values: list, op, *, data: bool = False):
        """All-reduce over every rank, or (``data``) over this rank's data-parallel group."""
        t = torch.tensor(values)
        self._dist.all_reduce(t, op=op, group=self._dp_group if data else None)
        return t

    def all_have_rows(self, n: int) -> bool:
        return int(self._reduce([n], self._dist.ReduceOp.MIN)[0]) > 0

    def share_batch(self, batch):
        """A CP group's ranks must train identical rows (their slices are of the same sequences): keyed
        sampling makes them so, and the group's first rank's batch is broadcast to the rest so no
        float or reward nondeterminism can make them differ (with TP, the first rank of the ``tp · cp`` block)."""
        if self.cp == 1:
            return batch
        s = self.share  # with tensor parallelism: the whole tp · cp block trains the same rows
        box = [batch.cpu() if self.rank % s == 0 else None]
        self._dist.broadcast_object_list(box, src=self.rank - self.rank % s, group=self._share_group)
        return box[0].to(batch.device)

    def global_normalizer(self, norm: T.Normalizer) -> T.Normalizer:
        t = self._reduce([float(norm.num_tokens), float(norm.num_seqs)], self._dist.ReduceOp.SUM, data=True)
        return T.Normalizer(t[0], t[1], norm.length_const)

    def pad_micro_batches(self, micros: list) -> list:
        most = int(self._reduce([len(micros)], self._dist.ReduceOp.MAX)[0])
        return micros + [None] * (most - len(micros))

    def gather_values(self, values: torch.Tensor) -> torch.Tensor:
        n = len(values)
        most = int(self._reduce([n], self._dist.ReduceOp.MAX, data=True)[0])
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.data_world)]
        self._dist.all_gather(sizes, torch.tensor([n]), group=self._dp_group)
        padded = torch.nn.functional.pad(values.detach().float().cpu(), (0, most - n))
        parts = [torch.zeros(most) for _ in range(self.data_world)]
        self._dist.all_gather(parts, padded, group=self._dp_group)
        return torch.cat([p[:int(k)] for p, k in zip(parts, sizes)]).to(values.device)

    def balance_rows(self, batch, pad_id: int = 0, model=None):
        """The step's groups over the data-parallel ranks split again so each rank's work is about equal — every
        rank learns each group's work (a few numbers a group), computes the same split, and only the rows that move
        are sent, once (a scatter from each rank: no rank ever holds the whole step's batch) — Karmarkar–Karp over
        the groups' work (:func:`hyperrl.transforms.balanced_partition`; verl's ``balance_batch``), so the ranks
        finish their forwards and backwards together. A row of ``L`` tokens works ``L + L² / (6·d)``: its linear
        layers ≈ ``24·L·d²`` FLOPs a layer, its attention ≈ ``4·L²·d`` (at d = 128 a 4,096-token row's attention
        is 5× its matmuls; ``d`` the ``model``'s ``config.hidden_size``; without one: tokens alone). A group
        (``group_id``: a prompt's samples, a preference pair) stays whole: its rows share a prompt forward and some
        losses read them together; on arrival ``group_id`` numbers the step's groups over all ranks. The gradient
        is unchanged (every loss is normalised by the global token count); only which rank computes which row.
        Returns ``(rows, metrics)``: ``balance_tokens_before`` / ``_after``, the most tokens a rank holds ÷ the
        mean (and ``balance_work_*``, of the work). A split leaving a rank without rows keeps the batch as it is
        (fewer groups than ranks)."""
        from hyperrl.trajectory import cat_batches, trim_padding

        W = self.data_world
        if W == 1:
            return batch, {}
        group, me = self._dp_group, self._dist.get_rank(self._dp_group)
        rows = batch.cpu()
        local = torch.unique(rows["group_id"], return_inverse=True)[1] if rows.batch_size[0] else rows["group_id"]
        hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
        tokens = rows["attention_mask"].sum(-1).long()
        work = tokens * (6 * hidden) + tokens ** 2 if hidden else tokens  # ∝ L + L² / (6·hidden), in integers
        n = int(local.max()) + 1 if len(local) else 0
        mine = [torch.zeros(n, dtype=torch.long).index_add_(0, local, v).tolist() for v in (tokens, work)]
        infos = [None] * W  # each rank's groups' (tokens, work): a few numbers a group, not the rows
        self._dist.all_gather_object(infos, mine, group=group)
        offsets = [sum(len(t) for t, _ in infos[:r]) for r in range(W)]
        per_unit = [w for _, ws in infos for w in ws]
        bins = sorted(T.balanced_partition(per_unit, W), key=lambda b: b[0] if b else len(per_unit))
        if any(not b for b in bins):
            return batch, {}
        unit_rank = torch.zeros(len(per_unit), dtype=torch.long)
        for r, b in enumerate(bins):
            unit_rank[torch.tensor(b)] = r
        units = local + offsets[me]  # group ids over the step
        rows = rows.copy().set("group_id", units)  # a new TensorDict: the caller's batch is not touched
        dest = unit_rank[units]
        got = []
        for src in range(W):  # only the rows that move, each sent once: rank src scatters its rows by destination
            out = [None]
            self._dist.scatter_object_list(out, [rows[dest == r] for r in range(W)] if me == src else None,
                                           group=group, group_src=src)
            got.append(out[0])
        arrived = trim_padding(cat_batches([g for g in got if g.batch_size[0]], pad_id)).to(batch.device)
        metrics = {}
        for k, name in enumerate(("tokens", "work")):
            per = [v for info in infos for v in info[k]]
            mean = sum(per) / W
            before = max(sum(info[k]) for info in infos)
            after = max(sum(per[u] for u in b) for b in bins)
            metrics[f"balance_{name}_before"], metrics[f"balance_{name}_after"] = before / mean, after / mean
        return arrived, metrics

    def agree_calls(self):
        def agree(n: int) -> int:
            return int(self._reduce([n], self._dist.ReduceOp.MAX)[0])

        return agree

    def agree_forward(self):
        def agree(use: bool, S: int) -> tuple[bool, int]:
            t = self._reduce([int(not use), S], self._dist.ReduceOp.MAX)
            return not bool(t[0]), int(t[1])

        return agree

    @torch.no_grad()
    def replicate(self, module: torch.nn.Module) -> torch.nn.Module:
        for t in [*module.parameters(), *module.buffers()]:
            self._dist.broadcast(t.data, src=0)
        return module

    @torch.no_grad()
    def sync_grads(self, params) -> None:
        """Σ over ranks ÷ world of each replicated gradient, in one coalesced all-reduce. Each rank's
        loss carries ``loss_scale = world`` (what FSDP's average needs), so the result is the sum of
        the ranks' gradients under the global normaliser — the same gradient FSDP computes. DTensor
        gradients (FSDP already reduced them) are left alone. Our own rather than DDP: DDP wraps the
        module (renaming every parameter and owning the forward), and a few MB of adapters need no
        bucketing or overlap."""
        from torch.distributed.tensor import DTensor

        params = list(params)
        self._sum_partial_over_tp(params)
        mine = {id(p) for p in params}
        experts = [p for p in self._experts if id(p) in mine]
        if experts:
            from hyperrl.distributed.expert_parallel import sync_expert_grads

            # each loss carries loss_scale = data_world; under CP each token's gradient is also cp × its share (the
            # gathered log-probs' backward sums the cp ranks' identical losses): ÷ (data_world · cp)
            sync_expert_grads(experts, self._replicas, 1.0 / (self.data_world * self.cp))
        ps = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
        if not ps:
            return
        for p in ps:  # a parameter unused on this rank still joins the sum (with zeros)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1).float() for p in ps])
        self._dist.all_reduce(flat)
        flat /= self.world
        for p, g in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p.grad))

    def _sum_partial_over_tp(self, params) -> None:
        """Σ over the TP group of the TP-partial gradients among ``params`` (one coalesced
        all-reduce of their local shards; FSDP's reduce over ``dp`` is linear, so the order is free)."""
        mine = {id(p) for p in params}
        from hyperrl.sharding.dtensor import local

        gs = [local(p.grad) for p in self._tp_partial if id(p) in mine and p.grad is not None]
        if not gs:
            return
        flat = torch.cat([g.reshape(-1) for g in gs])
        self._dist.all_reduce(flat, group=self._tp_group)
        for g, v in zip(gs, flat.split([g.numel() for g in gs])):
            g.copy_(v.view_as(g))

    def clip_grad_norm(self, params, max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        params = list(params)
        meshes = {id(p.grad.device_mesh) for p in params if isinstance(p.grad, DTensor)}
        if len(meshes) > 1:
            return self._clip_over_meshes(params, max_norm)
        gn = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(gn.full_tensor() if isinstance(gn, DTensor) else gn)

    @torch.no_grad()
    def _clip_over_meshes(self, params, max_norm: float) -> float:
        """Clip gradients living on several device meshes (TP × FSDP: 2-D ``(dp, tp)`` DTensors beside
        1-D ``dp`` ones, which ``clip_grad_norm_`` cannot stack). ‖g‖² = Σ over every rank of
        its local ‖g_local‖² ÷ the number of ranks holding an identical copy of that local shard
        (the size of the root mesh over the product of the sharded mesh axes) — one all-reduce.
        Then every gradient × min(1, max_norm / (‖g‖ + 1e-6)), torch's clip rule."""
        from torch.distributed.tensor import DTensor, Replicate

        sq, grads = torch.zeros((), dtype=torch.float64), []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                shards = 1
                for size, pl in zip(g.device_mesh.mesh.shape, g.placements):
                    shards *= 1 if isinstance(pl, Replicate) else int(size)
                copies, g = self.world / shards, g.to_local()
            else:
                copies = self.world
            sq += g.double().pow(2).sum() / copies
            grads.append(g)
        self._dist.all_reduce(sq)
        norm = float(sq.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def mean_metrics(self, metrics: dict) -> dict:
        """Numeric metrics averaged over ranks (a key some ranks lack averages over those that have it)."""
        mine = {k: float(v) for k, v in metrics.items()
                if isinstance(v, int | float) and k not in ("step", "policy_version")}
        names: list = [None] * self.world
        self._dist.all_gather_object(names, sorted(mine))
        keys = sorted(set().union(*names))
        t = torch.tensor([[mine.get(k, 0.0), float(k in mine)] for k in keys], dtype=torch.float64)
        self._dist.all_reduce(t)
        return {**metrics, **{k: s / c for k, (s, c) in zip(keys, t.tolist()) if c}}

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        names: list = [None] * self.world
        self._dist.all_gather_object(names, sorted(sums))
        keys = sorted(set().union(*names))
        t = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64)
        self._dist.all_reduce(t, group=self._dp_group)  # a TP / CP group's ranks hold the same numbers
        return dict(zip(keys, t.tolist()))

    def _over_ranks(self, values: list[float], op) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        self._dist.all_reduce(t, op=op)
        return t.tolist()

    def min_over_ranks(self, values: list[float]) -> list[float]:
        return self._over_ranks(values, self._dist.ReduceOp.MIN)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        return self._over_ranks(values, self._dist.ReduceOp.SUM)

    def gather_objects(self, obj) -> list:
        out: list = [None] * self.world
        self._dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self._dist.barrier()


def make_parallel(dims=None) -> LocalParallel:
    """The strategy for the run's parallel dims (a :class:`~hyperrl.distributed.dims.ParallelDims`;
    None: this world, data-parallel only): :class:`TorchParallel` under an initialised
    process group of > 1 rank, else :class:`LocalParallel`."""
    import torch.distributed as dist

    from hyperrl.distributed.dims import ParallelDims

    tp, cp = (1, 1) if dims is None else (dims.tp, dims.cp)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchParallel(dims if dims is not None else ParallelDims(world=dist.get_world_size()))
    if tp != 1:
        raise ValueError(f"run.tp={tp}: tensor parallelism needs torchrun with a multiple of {tp} processes")
    if cp != 1:
        raise ValueError(f"run.cp={cp}: context parallelism needs torchrun with a multiple of {cp} processes")
    return LocalParallel()


TorchDataParallel = TorchParallel  # the name earlier releases used
