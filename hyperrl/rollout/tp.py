"""A tensor-parallel transformers engine: vLLM's parameter layout, served by HF modules.

:class:`TPTransformersEngine` splits a dense decoder (Qwen3 / Qwen2 / Llama / Mistral) or a mixture (Qwen3-MoE) over TP
groups of ``tp`` consecutive ranks the way vLLM does, and its publication layout *is* vLLM's
(:func:`hyperrl.sharding.models.rollout_layout`): fused ``qkv_proj`` (kv heads replicated when
``tp > n_kv``), fused ``gate_up_proj``, row-parallel ``o_proj`` / ``down_proj``, the vocabulary
padded to a multiple of 64 and split. A publisher therefore sends each rank only its local fused
shards. Each rank runs an HF model built with its *local* head and MLP counts — as vLLM builds
its modules — whose q / k / v and gate / up weights are cut out of the fused shards at commit;
a mixture of experts' layers keep their router whole and hold ``E / tp`` whole experts per rank
(:class:`GroupExperts`: every rank of a group sees every token, so each runs its own experts on the
tokens routed to them and the group's all-reduce sums the contributions — vLLM's expert-parallel
layout when one group serves, ``rollout_layout(ep=tp)``); the TP collectives are forward hooks
(all-reduce after the row-parallel layers, the experts and the vocab-parallel embedding, all-gather of
the vocab-parallel logits). Every rank of a group samples
the same tokens (the group's first rank's draw is broadcast: no drift, no hang).

Publication stays all-or-nothing *across the group*: a piece refused on one rank (NaN, wrong
shape) is held until ``commit``, where the group agrees — one refusal and every rank keeps
serving version ``V``, never a mix of versions inside one model.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from hyperrl.rollout.base import TransactionalEngine, WeightPublishError, transformers_capabilities
from hyperrl.rollout.hf import TransformersEngine

__all__ = ["TPTransformersEngine", "VocabParallelEmbedding", "GatheredLMHead", "GroupExperts"]


class VocabParallelEmbedding(torch.nn.Module):
    """Rows ``[start, start + n)`` of a (padded) embedding; ids outside them look up zeros, and
    the group's all-reduce sums the one rank that holds each id. ``[B, T] → [B, T, H]``."""

    def __init__(self, rows: int, hidden: int, start: int, group):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, hidden), requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        dist.all_reduce(out, group=self.group)
        return out


class GatheredLMHead(torch.nn.Module):
    """Vocab-parallel logits ``h @ W_localᵀ``, all-gathered over the group and cut to the true
    vocabulary (the padding rows are not tokens). ``[B, T, H] → [B, T, V]``."""

    def __init__(self, weight: torch.nn.Parameter, vocab: int, group, tp: int):
        super().__init__()
        self.weight, self.vocab, self.group, self.tp = weight, vocab, group, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = torch.nn.functional.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, -1)[..., : self.vocab]


class GroupExperts(torch.nn.Module):
    """Experts ``[first, first + n)`` of a stacked-experts layer (``gate_up_proj [n, 2I, H]``,
    ``down_proj [n, H, I]``), called as transformers' ``experts(hidden [N, H], top_k_index [N, k],
    top_k_weights [N, k])``: ``Σ`` over the (token, slot) pairs routed to a local expert of
    ``w · down(act(gate) · up)``; the other experts' pairs contribute 0 here and their rank's share
    arrives through the group's all-reduce (a forward hook)."""

    def __init__(self, n: int, first: int, inter: int, hidden: int, act_fn, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(n, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.zeros(n, hidden, inter, dtype=dtype), requires_grad=False)
        self.first, self.n, self.act_fn = first, n, act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.n):
            token, slot = torch.where(top_k_index == self.first + e)
            if not len(token):
                continue
            gate, up = torch.nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def _all_reduce_output(group):
    def hook(module, args, out):
        dist.all_reduce(out, group=group)
        return out

    return hook


def _local_model(model, cfg, tp: int, tp_rank: int, group, dtype: torch.dtype):
    """An HF model of ``model``'s class with this rank's head / MLP counts, vocab-parallel
    embedding and head, and the row-parallel all-reduces (weights filled at the first commit)."""
    c = copy.deepcopy(model.config)
    c.num_attention_heads, c.intermediate_size = cfg.heads // tp, cfg.intermediate // tp
    c.num_key_value_heads = max(cfg.kv_heads // tp, 1)  # tp > n_kv: one replicated kv head per rank
    c.head_dim = cfg.head_dim  # families that derive it from hidden / heads would get the local count wrong
    local = type(model)(c).to(dtype)
    rows = -(-cfg.vocab // 64) * 64 // tp
    emb = VocabParallelEmbedding(rows, cfg.hidden, tp_rank * rows, group).to(dtype)
    local.model.embed_tokens = emb
    head = emb.weight if cfg.tied else torch.nn.Parameter(torch.zeros(rows, cfg.hidden, dtype=dtype),
                                                          requires_grad=False)
    local.lm_head = GatheredLMHead(head, cfg.vocab, group, tp)
    for i, layer in enumerate(local.model.layers):
        layer.self_attn.o_proj.register_forward_hook(_all_reduce_output(group))
        if cfg.is_moe(i):
            per = cfg.experts // tp
            layer.mlp.experts = GroupExperts(per, tp_rank * per, cfg.expert_intermediate, cfg.hidden,
                                             layer.mlp.experts.act_fn, dtype)
            layer.mlp.experts.register_forward_hook(_all_reduce_output(group))
        else:
            layer.mlp.down_proj.register_forward_hook(_all_reduce_output(group))
    return local.requires_grad_(False).eval()


class TPTransformersEngine(TransformersEngine):
    """``model`` (full weights, the engine's dtype) served over TP groups of ``tp`` consecutive
    ranks of the initialised process group; ``layout(world)`` is vLLM's layout on
    ``dp = world / tp`` replicas (see the module doc)."""

    def __init__(self, model, tp: int, *, device: str | torch.device = "cpu", pad_id: int = 0, version: int = 0):
        from hyperrl.sharding.models import from_hf_config
        from hyperrl.sharding.simulate import expected_destination
        from hyperrl.sharding.vllm import rollout_layout

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() % tp:
            raise ValueError(f"rollout.engine.tp={tp}: needs an initialised process group whose size divides by {tp}")
        world, rank = dist.get_world_size(), dist.get_rank()
        cfg = from_hf_config(model.config.to_dict())
        if cfg.mla or cfg.shared_experts or cfg.shared_intermediate:
            raise ValueError(f"rollout.engine.tp={tp}: the transformers TP engine serves dense decoders and "
                             f"mixtures without shared experts; {cfg.name} has MLA / shared experts (use vLLM)")
        if cfg.experts and cfg.experts % tp:
            raise ValueError(f"rollout.engine.tp={tp} must divide the model's experts per layer ({cfg.experts}): "
                             "each rank of a group holds whole experts")
        stacked = cfg.experts and any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())
        if cfg.experts and not stacked:
            raise ValueError(f"rollout.engine.tp={tp}: {cfg.name}'s experts are not stacked (mlp.experts.gate_up_proj, "
                             "transformers ≥ 5); the TP engine serves stacked experts")
        for what, n in (("num_attention_heads", cfg.heads), ("intermediate_size", cfg.intermediate)):
            if n % tp:
                raise ValueError(f"rollout.engine.tp={tp} must divide the model's {what} ({n})")
        if cfg.kv_heads % tp and tp % cfg.kv_heads:
            raise ValueError(f"rollout.engine.tp={tp}: num_key_value_heads ({cfg.kv_heads}) must divide by tp or "
                             f"divide it")
        group = None
        for g in range(world // tp):  # every rank creates every group, in order
            ranks = list(range(g * tp, (g + 1) * tp))
            made = dist.new_group(ranks)
            if rank in ranks:
                group, self._leader = made, ranks[0]
        self.tp, self.group, self.tp_rank, self._world = tp, group, rank % tp, world
        dtype = next(model.parameters()).dtype
        self._layout = rollout_layout(cfg, tp=tp, dp=world // tp, dtype=dtype, ep=tp if cfg.experts else 1,
                                      stacked_experts=bool(cfg.experts))
        super().__init__(_local_model(model, cfg, tp, rank % tp, group, dtype), device=device, pad_id=pad_id,
                         version=version)
        self.capabilities = transformers_capabilities(tp=tp)
        self._aliases, self._refused = {}, None
        params = dict(self.model.named_parameters())
        self._expect, self._splits = {}, {}
        for name, p in self._layout.params.items():
            pos = p.mesh.ranks.index(rank)
            self._expect[name] = torch.empty(p.local_shape(pos), dtype=p.dtype, device="meta")
            self._splits[name] = (p.cat_dim, [(params[part.blocks[0].src], box.sizes[p.cat_dim])
                                              for part, box in zip(p.parts, p.local_boxes[pos])])
        full = {k: v.detach() for k, v in model.state_dict().items()}
        with torch.no_grad():
            self._apply(expected_destination(self._layout, full, ranks=[rank])[rank], version)

    def layout(self, replicas: int = 1):
        """vLLM's layout of this model on ``replicas / tp`` TP groups (``replicas``: the ranks serving it)."""
        if replicas != self._world:
            raise ValueError(f"a TP engine spans all {self._world} ranks; asked for a layout on {replicas}")
        return self._layout

    def _expected(self):
        return self._expect

    # deltas apply to copies and are staged like any piece (the group decides together at commit), not in place
    stage_deltas = TransactionalEngine.stage_deltas

    def _apply(self, staged: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            for name, t in staged.items():
                dim, targets = self._splits[name]
                for (param, _), piece in zip(targets, t.split([n for _, n in targets], dim)):
                    param.copy_(piece.to(param.dtype))
        self._failed = None

    # ------------------------------------------------------------------ group-wide all-or-nothing
    def begin(self, version: int, *, partial: bool = False, base: int | None = None) -> None:
        super().begin(version, partial=partial, base=base)
        self._refused = None

    def stage(self, pieces) -> None:
        """Check and hold ``pieces``; a refusal is kept for :meth:`commit` (the group decides together)."""
        if self._txn is None:
            raise WeightPublishError("stage() without begin(version)")
        if self._refused is None:
            try:
                self._txn.add_all(pieces, self._stage_one)
            except WeightPublishError as e:
                self._refused = e

    def commit(self) -> None:
        if self._txn is None:
            raise WeightPublishError("commit() without begin(version)")
        txn, self._txn, err = self._txn, None, self._refused
        staged = None
        if err is None:
            try:
                staged = txn.complete()
            except WeightPublishError as e:
                err = e
        ok = torch.tensor([int(err is None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not bool(ok):
            raise err or WeightPublishError(f"version {txn.version} was refused by another rank of this TP group; "
                                            f"still serving version {self.policy_version}")
        self._apply(staged, txn.version)
        self._version = txn.version

    def _agree(self, tok: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tok, src=self._leader, group=self.group)
        return tok
