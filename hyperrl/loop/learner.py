"""The learner: optimizers and the learning-rate schedule as its state, one composed loss function.

``Learner.update(batch, loss_fn)`` runs ``epochs × mini-batches × micro-batches``: a seeded
mini-batch order, the step's global normaliser (from the data-parallel strategy), micro-batches
by padded token budget, each cut to its own longest row (padded across ranks with zero-weight
passes), ``backward`` of
``loss_fn(micro, normalizer).loss`` scaled by the strategy, then one clipped optimizer step per
mini-batch for every module. The policy and a critic are just two entries of ``modules``; the
critic's value loss is one more ``loss_*`` term of the same loss function.

Metric accumulation: a ``loss_*`` term is the loss of its optimizer step — the sum over the
micro-batches (and, times the strategy's loss scale, over ranks: each holds its share under the
global normaliser) — averaged over the mini-batches by rows; every other metric is averaged over
the rows (weight ``rows / B / epochs``), except keys containing ``_max`` (the maximum).
``grad_norm`` is the largest pre-clip norm of the step's optimizer steps; ``lr`` the last policy
learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.distributed.strategy import LocalParallel
from hyperrl.multimodal import row_patches
from hyperrl.trajectory import real_extent, trim_padding
from hyperrl.transforms.schedules import lr_multiplier

__all__ = ["Learner", "Optimized", "micro_batches", "map_micro_batches"]


def micro_batches(batch: TensorDict, budget: int) -> list[list[int]]:
    """Row indices of ``batch`` in micro-batches whose padded cost — rows × the longest row, what
    the forward computes once each is cut to its own width (:func:`hyperrl.trajectory.trim_padding`)
    — is at most ``budget`` tokens (0 = one micro-batch). The samples of a prompt (``group_id``)
    stay together while they fit (a shared-prefix forward runs their prompt once) and rows are
    grouped by length (:func:`hyperrl.transforms.micro_batches_by_padded_budget`). A vision-language row
    counts its image patches too (what its vision-tower forward computes): its length is its tokens plus
    its patches, so the images of a step do not grow a micro-batch's memory past the budget."""
    B = batch.batch_size[0]
    if not B:
        return []
    if not budget:
        return [list(range(B))]
    groups = batch["group_id"] if "group_id" in batch.keys() else torch.arange(B)
    lengths = real_extent(batch)
    if "image_grid_thw" in batch.keys():
        lengths = lengths + row_patches(batch["image_grid_thw"]).to(lengths.device)
    return T.micro_batches_by_padded_budget(lengths, groups, budget)


@torch.no_grad()
def map_micro_batches(fn, batch: TensorDict, budget: int, parallel: LocalParallel | None = None):
    """``fn(rows) -> tensor | tuple of tensors`` (each ``[b]`` or per-token ``[b, w, …]``) over the
    micro-batches of :func:`micro_batches`, each cut to its own width ``w``; per-token outputs are
    padded back to ``T`` with zeros (−1 for integer routes ``[b, w, L, k]``), everything reassembled
    in row order — a no-grad forward whose memory is bounded by the micro-batch.
    Ranks with fewer micro-batches call ``fn(batch[:1])`` and drop the result (FSDP's lockstep)."""
    parallel = parallel or LocalParallel()
    outs, order = [], []
    Tn = batch["tokens"].shape[1]
    for micro in parallel.pad_micro_batches(micro_batches(batch, budget)):
        if micro is None:
            fn(trim_padding(batch[:1]))
            continue
        idx = torch.tensor(micro)
        rows = trim_padding(batch[idx])
        r = fn(rows)
        single = not isinstance(r, tuple)
        w = rows["tokens"].shape[1]  # per-token outputs [b, w] back to [b, T] (zeros on the cut padding)
        outs.append(tuple(_pad_width(x, w, Tn) for x in ((r,) if single else r)))
        order.append(idx)
    if not outs:
        raise ValueError("map_micro_batches: the batch has no rows")
    inverse = torch.argsort(torch.cat(order))
    res = tuple(torch.cat(parts, 0)[inverse] for parts in zip(*outs))
    return res[0] if single else res


def _pad_width(x: torch.Tensor, w: int, Tn: int) -> torch.Tensor:
    """A per-token output ``[b, w, …]`` padded to ``[b, T, …]``: zeros, or −1 for integer outputs
    with trailing dims (routes ``[b, w, L, k]``, where 0 is an expert id)."""
    if x.dim() < 2 or x.shape[1] != w or w == Tn:
        return x
    fill = -1 if x.dim() > 2 and not x.is_floating_point() else 0
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, Tn - w), value=fill)


@dataclass
class Optimized:
    """One trained module: its optimizer and base learning rate."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr: float


class Learner:
    """The optimizer side of a step: ``modules`` (name → :class:`Optimized`: a module, its optimizer and base lr)
    updated by one composed loss over epochs × mini-batches × micro-batches, with the lr schedule
    (:func:`hyperrl.transforms.lr_multiplier`), the global token normaliser and gradient clipping at
    ``grad_clip``; every collective through ``parallel``."""

    def __init__(self, modules: dict[str, Optimized], *, grad_clip: float, schedule: str = "constant",
                 total_steps: int = 1, warmup: int = 0, min_lr_ratio: float = 0.0,
                 parallel: LocalParallel | None = None):
        self.modules = modules
        self.grad_clip, self.schedule, self.total = grad_clip, schedule, max(total_steps, 1)
        self.warmup, self.min_lr_ratio = warmup, min_lr_ratio
        self.parallel = parallel or LocalParallel()
        self.optim_steps = 0  # the schedule's only state (checkpointed)

    def update(self, batch: TensorDict, loss_fn: Callable[[TensorDict, T.Normalizer], T.LossOutput], *,
               epochs: int = 1, mini_batches: int = 1, seed: int = 0, micro_batch_tokens: int = 0,
               length_const: float | None = None) -> dict:
        """Train on ``batch``; returns the accumulated metrics (see the module doc)."""
        B = batch.batch_size[0]
        totals: dict[str, float] = {}
        order = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
        # the rows' images are the one per-row payload far larger than their tokens: a mini-batch is planned on the
        # rest, and each micro-batch gathers its own rows' images only — a shuffled copy of every image of the step
        # would grow the update's memory with the images per step (benchmarks/vision.py --what memory)
        light = batch.exclude("pixel_values") if "pixel_values" in batch.keys() else batch
        for _ in range(epochs):
            for idx in order.tensor_split(mini_batches):  # the same count on every rank, maybe empty
                mini = light[idx]
                norm = self.parallel.global_normalizer(T.Normalizer.from_mask(mini["action_mask"], length_const))
                step_terms: dict[str, float] = {}
                for micro in self.parallel.pad_micro_batches(micro_batches(mini, micro_batch_tokens)):
                    if micro is None:  # this rank has run out: a zero-weight pass keeps FSDP in step
                        (loss_fn(trim_padding(batch[:1]), norm).loss * 0.0).backward()
                        continue
                    out = loss_fn(trim_padding(batch[idx[torch.tensor(micro)]]), norm)
                    (out.loss * self.parallel.loss_scale).backward()
                    for k, v in out.terms.items():
                        step_terms[k] = step_terms.get(k, 0.0) + float(v.detach()) * self.parallel.loss_scale
                    _accumulate(totals, {k: float(v) for k, v in out.metrics.items()}, len(micro) / B / epochs)
                _accumulate(totals, step_terms, len(idx) / B / epochs)
                gn = self._step()
                totals["grad_norm"] = max(totals.get("grad_norm", 0.0), gn)
                totals["lr"] = self.current_lr
        return totals

    def _step(self) -> float:
        """Set every learning rate from the schedule, clip, step and zero each module; the policy's norm."""
        m = lr_multiplier(self.optim_steps, schedule=self.schedule, total=self.total, warmup=self.warmup,
                          min_ratio=self.min_lr_ratio)
        norms = []
        for part in self.modules.values():
            for g in part.optimizer.param_groups:
                g["lr"] = part.lr * m
            self.parallel.sync_grads(part.module.parameters())
            norms.append(self.parallel.clip_grad_norm(part.module.parameters(), self.grad_clip))
            part.optimizer.step()
            part.optimizer.zero_grad(set_to_none=True)
        self.optim_steps += 1
        self.current_lr = next(iter(self.modules.values())).lr * m
        return norms[0]


def _accumulate(totals: dict, values: dict, w: float) -> None:
    for k, v in values.items():
        totals[k] = max(totals.get(k, v), v) if "_max" in k else totals.get(k, 0.0) + v * w
