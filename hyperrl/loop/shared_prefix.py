"""The shared-prefix forward: a GRPO-style batch's log-probs and entropies with each distinct prompt run once.

GRPO-style batches hold ``n`` samples per prompt, so the prompt is the same in ``n`` rows. The prompt is run **once
per distinct prompt** (with autograd), its KV cache is indexed out to every row (indexing is differentiable: the
prompt's gradient is the sum over its rows), and only the tokens after the prompt run per row — in buckets of
similar length where that pays. The "shared-prefix forward" of Prefix Grouper (Liu et al., 2025,
arXiv:2506.05433): forward cost drops from ``B·(T − 1)`` tokens to ``U·P + B·(S − 1)`` (``U`` distinct prompts of up
to ``P`` tokens, ``S`` tokens after them); with one-token answers the per-row part vanishes. :func:`choose` says
when it is the cheaper forward (:func:`hyperrl.loop.forward.policy_logprobs` asks it).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.loop.model_calls import RouteReplay, head_out, lp_ent, route_call, vision_inputs
from hyperrl.multimodal import vision_identity

__all__ = ["shared_prefix_logprobs_and_entropy", "prefix_groups", "choose", "BUCKET_CALL_COST", "BUCKET_MIN_WIDTH"]


# a model call's fixed cost in tokens, for bucketing a continuation (length_buckets): a split must save more tokens
# than this per extra call. Measured on 2 cores (2026-12-07, a continuation call forward + backward at several rows ×
# widths, fitted time = fixed + per token): the default tiny model's (hidden 128, 2 layers) fixed part is ≈ 3 ms ≈ 95
# of its tokens, the e2e model's (256 × 4) ≈ 9 ms ≈ 80 tokens; 256 leaves a margin
BUCKET_CALL_COST = 256
# continuations narrower than this stay in one call: a split saves under this many tokens a row, where the prompt pass
# and the head are most of the forward (and the default job's 3-token answers keep their numbers)
BUCKET_MIN_WIDTH = 8


def prefix_groups(batch: TensorDict):
    """Rows that share a prompt. The prompt of row ``b`` is ``tokens[b, :p_b]``, ``p_b`` the index
    of its first action token (its length when it has none) — with its images, when the rows carry
    some (two prompts with the same placeholder tokens but other images differ). Returns ``(p [B],
    inverse [B], first [U])``: ``inverse[b]`` numbers row ``b``'s distinct prompt, ``first[u]`` is a
    row holding prompt ``u``."""
    tokens, act = batch["tokens"], batch["action_mask"]
    length = batch["attention_mask"].sum(-1)
    p = torch.where(act.any(-1), act.int().argmax(-1), length)
    P = int(p.max())
    keys = torch.where(torch.arange(P)[None, :] < p[:, None], tokens[:, :P], -1)
    images = vision_identity(batch).to(keys.device)
    inverse = _unique_rows(torch.cat([p[:, None], images[:, None], keys], 1))
    B = len(p)
    first = torch.full((int(inverse.max()) + 1,), B).scatter_reduce(0, inverse, torch.arange(B), "amin")
    return p, inverse, first


def _unique_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.unique(x, dim=0, return_inverse=True)[1]`` for an integer ``[B, K]``: each row's index among the
    distinct rows in lexicographic order — by Python tuples (torch's CPU ``unique_dim`` selects and compares row by
    row: ≈ 1.5 ms at the default job's 512 × 9, against ≈ 0.3 ms here)."""
    rows = list(map(tuple, x.tolist()))
    number = {r: i for i, r in enumerate(sorted(set(rows)))}
    return torch.tensor([number[r] for r in rows], dtype=torch.long, device=x.device)


def shared_prefix_logprobs_and_entropy(model, batch: TensorDict, temperature: float, groups=None, *,
                                       min_rest: int = 0, replay: RouteReplay | None = None, fused: bool = False,
                                       bucket: bool = True):
    """As :func:`plain_logprobs_and_entropy` on action positions, with each distinct prompt run once.

    Prompts ``[U, P]`` are left-padded so every row's continuation starts at cache slot ``P``;
    the continuation ``[B, S − 1]`` (all tokens after the prompt but the last) runs on the
    indexed cache with positions ``p_b + s``. Logits: the prompt's last one predicts the first
    continuation token, continuation logit ``s`` predicts token ``s + 1``. ``min_rest ≥ 1`` runs
    the continuation forward even when every row ends one token after its prompt (data-parallel
    ranks must make the same number of model calls under FSDP).

    ``bucket`` (a text model, no routing replay, a continuation of at least :data:`BUCKET_MIN_WIDTH` tokens):
    the continuation runs in buckets of similar length (:func:`hyperrl.transforms.length_buckets`, each call cut
    to its rows' longest continuation) when that saves more than :data:`BUCKET_CALL_COST` tokens a call — at a
    long-tailed step (responses of 1–64 tokens) ≈ a quarter fewer tokens through the model (8,064 → 6,160 at a
    step of ``benchmarks/e2e.py --shape short64x4``); the same numbers up to the matrix products' rounding. Off under
    FSDP, whose ranks must make the same calls (:func:`policy_logprobs` turns it off when the forward is agreed).
    """
    tokens, attn = batch["tokens"], batch["attention_mask"]
    p, inverse, first = groups if groups is not None else prefix_groups(batch)
    if int(p.min()) < 1:
        raise ValueError("action_mask: position 0 is an action; a sequence must start with a prompt token")
    dev = tokens.device
    P, S = int(p.max()), max(int((attn.sum(-1) - p).max()), min_rest + 1)
    j = torch.arange(P, device=dev)[None, :]
    src = j - (P - p[first, None])  # left-pad each distinct prompt to P
    pre_mask = src >= 0
    pre_ids = torch.where(pre_mask, tokens[first].gather(1, src.clamp_min(0)), 0)
    pre_pos = (pre_mask.long().cumsum(-1) - 1).clamp_min(0)
    kw = vision_inputs(model, batch, pre_ids, pre_mask, first)  # a VLM: the prompts' images, M-RoPE positions
    if "position_ids" in kw:
        pre_pos = kw.pop("position_ids")  # [3, U, P]
    Tn = tokens.shape[1]
    t = torch.arange(Tn, device=dev)[None, :]
    src = torch.where(t < p[:, None], inverse[:, None] * P + (P - p[:, None]) + t, -1)  # row b's prompt in its u
    with route_call(replay, src, len(first) * P):
        out = head_out(model, fused, input_ids=pre_ids, attention_mask=pre_mask.long(), position_ids=pre_pos,
                       use_cache=S > 1, logits_to_keep=1, **kw)
    logits = _rows(out.logits[:, -1], inverse)[:, None]  # [B, 1, V]: predicts the first token after the prompt
    s = torch.arange(max(S, 1), device=dev)[None, :]
    cont_valid = s < (attn.sum(-1) - p)[:, None]
    cont = torch.where(cont_valid, tokens.gather(1, (p[:, None] + s).clamp_max(tokens.shape[1] - 1)), 0)
    if S > 1:
        buckets = [(None, S - 1)]  # one call: every row, the agreed width (min_rest: even with nothing to run)
        if bucket and replay is None and pre_pos.dim() == 2 and S - 1 >= BUCKET_MIN_WIDTH:
            needs = (attn.sum(-1) - p - 1).clamp_min(0)  # continuation inputs row b needs: its tokens but the last
            rows = T.length_buckets(needs, BUCKET_CALL_COST)
            if len(rows) > 1:  # several calls, each cut to its rows' longest continuation
                buckets = [(torch.tensor(r, device=dev), int(needs[r].max())) for r in rows]
        rest = _continuation(model, fused, out.past_key_values, buckets, inverse, pre_mask, pre_pos, p,
                             cont[:, :-1], cont_valid[:, :-1], S - 1, Tn, replay)
        logits = torch.cat([logits, rest], 1)
    return _scatter_lp(model, logits, cont, cont_valid, p, Tn, temperature, fused)


def _scatter_lp(model, logits, cont, cont_valid, p, Tn: int, temperature: float, fused: bool):
    """The continuation's log-probs and entropies ``[B, S]`` (from its logits or hidden states) at their tokens'
    positions ``[B, T]``, zero elsewhere."""
    lp, ent = lp_ent(model, logits, cont, temperature, fused)
    B, S = cont.shape
    cols = p[:, None] + torch.arange(S, device=cont.device)[None, :]  # distinct per row; the buffer is wide
    zero = torch.zeros(B, Tn + S, dtype=lp.dtype, device=cont.device)  # enough for rows' padding tails
    lp_full = zero.scatter(1, cols, torch.where(cont_valid, lp, 0.0))[:, :Tn]
    ent_full = zero.scatter(1, cols, torch.where(cont_valid, ent, 0.0))[:, :Tn]
    return lp_full, ent_full


def _continuation(model, fused: bool, cache, buckets: list, inverse, pre_mask, pre_pos, p, inputs, valid, width: int,
                  Tn: int, replay: RouteReplay | None) -> torch.Tensor:
    """The continuation's logits (or hidden states) ``[B, width, ·]``: one model call per bucket ``(rows, w)`` — the
    rows (None: every row, in order) on their prompts' cached K/V, ``inputs [B, width]`` cut to the bucket's width
    ``w`` (≥ 1; a bucket of rows with nothing to run, ``w = 0``, makes no call: zeros). Positions count on from each
    prompt's largest (its last token's for text; M-RoPE: the largest over the three axes, as the engine decodes);
    ``replay`` maps the call's tokens to batch positions (``src``). Positions past a row's bucket width are zeros
    (never read: past its last token)."""
    kv, dev = _cache_kv(cache), inputs.device
    last = pre_pos[..., -1].amax(0) if pre_pos.dim() == 3 else pre_pos[:, -1]
    parts, order, empty = [], [], []
    for idx, w in buckets:
        if w == 0:  # one-token responses: predicted by the prompt's last logit alone
            empty.append(idx)
            continue
        u = inverse if idx is None else inverse[idx]
        for la, (k, v) in zip(cache.layers, kv):
            if k is not None:
                la.keys, la.values = _rows(k, u), _rows(v, u)
        ids, ok = (inputs, valid) if idx is None else (inputs[idx], valid[idx])
        ids, ok = ids[:, :w], ok[:, :w]
        s = torch.arange(w, device=dev)[None, :]
        pos = last.index_select(0, u)[:, None] + 1 + s
        if pre_pos.dim() == 3:
            pos = pos.expand(3, -1, -1)
        src = None if replay is None else _call_src(idx, ok, p, s, w, Tn)
        with route_call(replay, src, len(u) * w):
            out = head_out(model, fused, input_ids=ids, attention_mask=torch.cat([pre_mask[u], ok], 1).long(),
                           position_ids=pos, past_key_values=cache, use_cache=False).logits
        if idx is None:  # every row in one call: already in order
            return out if w == width else torch.nn.functional.pad(out, (0, 0, 0, width - w))
        parts.append(torch.nn.functional.pad(out, (0, 0, 0, width - w)))
        order.append(idx)
    if empty:  # rows without a continuation input: zeros
        like = parts[0]
        parts.append(like.new_zeros(sum(len(e) for e in empty), *like.shape[1:]))
        order += empty
    return torch.cat(parts, 0).index_select(0, torch.argsort(torch.cat(order)))


def _call_src(idx, ok: torch.Tensor, p: torch.Tensor, s: torch.Tensor, w: int, Tn: int) -> torch.Tensor:
    """``src [B, T]`` of a continuation call over rows ``idx`` (None: all), ``ok [b, w]`` its real inputs: the
    call's token index ``j · w + s`` at batch position ``(idx[j], p + s)``, −1 elsewhere (:class:`RouteReplay`)."""
    n = ok.shape[0]
    rows = torch.arange(n, device=ok.device) if idx is None else idx
    B = n if idx is None else int(p.shape[0])
    src = torch.full((B, Tn), -1, dtype=torch.long, device=ok.device)
    j = torch.arange(n, device=ok.device)[:, None].expand_as(ok)
    src[rows[:, None].expand_as(ok)[ok], (p[rows][:, None] + s).expand_as(ok)[ok]] = (j * w + s)[ok]
    return src


def _cache_kv(cache) -> list[tuple]:
    """Every layer's ``(keys, values)`` of a transformers cache (None where a layer holds none)."""
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(la, "keys") and hasattr(la, "values") for la in layers):
        raise TypeError(f"shared-prefix forward: unsupported cache type {type(cache).__name__} (needs per-layer "
                        "keys/values, transformers' DynamicCache); use optim.shared_prefix=false")
    return [(la.keys, la.values) if la.keys is not None and la.keys.numel() else (None, None) for la in layers]


class _Rows(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward makes the incoming gradient contiguous before autograd's own
    ``zeros.index_add_(0, index, grad)`` — the same sums in the same order, bit for bit. The gradient of a row's
    cached K/V arrives as a slice of the continuation's concatenated K/V (non-contiguous), and ``index_add_`` over a
    non-contiguous source ran ≈ 4× slower (0.36 ms a call at the default job's [512, 2, 7, 32] → [32, …])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add_(0, index, grad.contiguous()), None


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``x`` (:class:`_Rows` where a gradient flows)."""
    return _Rows.apply(x, index) if x.requires_grad else x.index_select(0, index)


def choose(batch: TensorDict, shared_prefix: bool = True):
    """``(use the shared-prefix forward, tokens after the longest prompt S, prefix_groups or None)``:
    shared when it runs fewer tokens (``U < B`` and ``U·P + B·(S − 1) < B·(T − 1)``)."""
    if not shared_prefix or batch.batch_size[0] < 2 or not bool(batch["action_mask"].any()):
        return False, 0, None
    groups = prefix_groups(batch)
    p, _, first = groups
    B, Tn = batch["tokens"].shape
    S = int((batch["attention_mask"].sum(-1) - p).max())
    U = len(first)
    return int(p.min()) >= 1 and U < B and U * int(p.max()) + B * max(S - 1, 0) < B * (Tn - 1), S, groups
