"""Policy forwards: token-aligned log-probs and entropies of a trajectory batch under a causal LM.

Two ways to the same numbers (up to float rounding):

* :func:`plain_logprobs_and_entropy` — one forward over every padded row ``[B, T]``.
* :func:`shared_prefix_logprobs_and_entropy` — GRPO-style batches hold ``n`` samples per prompt,
  so the prompt is the same in ``n`` rows. The prompt is run **once per distinct prompt** (with
  autograd), its KV cache is indexed out to every row (indexing is differentiable: the prompt's
  gradient is the sum over its rows), and only the tokens after the prompt run per row. The
  "shared-prefix forward" of Prefix Grouper (Liu et al., 2025, arXiv:2506.05433): forward cost
  drops from ``B·(T − 1)`` tokens to ``U·P + B·(S − 1)`` (``U`` distinct prompts of up to ``P``
  tokens, ``S`` tokens after them); with one-token answers the per-row part vanishes.

:func:`policy_logprobs` picks the cheaper of the two by that token count. Output positions
``t ≤ prefix`` (the prompt) and padding are 0 in the shared-prefix path; only action positions
are meaningful in either (every consumer masks by ``action_mask``).
"""

from __future__ import annotations

import contextlib

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.models.head import head_skipped, head_weights
from hyperrl.multimodal import VisionError, forward_inputs, row_patches, vision_identity, vision_spec

__all__ = ["plain_logprobs_and_entropy", "shared_prefix_logprobs_and_entropy", "packed_logprobs_and_entropy",
           "context_parallel_logprobs_and_entropy", "context_parallel_values", "policy_logprobs",
           "prefix_groups", "choose", "RouteReplay", "full_vocab_divergence"]


class RouteReplay:
    """A mixture-of-experts forward's routing over a batch ``[B, T]`` (docs/moe.md): ``routes``
    ``[B, T, L, k]`` — the reference each call's tokens are compared with (the agreement counters of
    ``routing``, a :class:`hyperrl.models.Routing`) and, with ``force``, routed by; ``None`` captures
    only. After the pass ``captured [B, T, L, k]`` (int16) holds the experts every token ran (−1
    where no call ran it: a row's last token, padding). The forwards below map each model call's
    ``N`` tokens to batch positions with ``src [B, T]`` (the call's token index, −1 = not in it); a call over a
    context-parallel ``group`` (each rank a slice of the sequence) merges the ranks' captures and agreement counts
    afterwards, so every rank holds the whole batch's."""

    def __init__(self, routing, batch: TensorDict, routes: torch.Tensor | None = None, force: bool = False):
        B, Tn = batch["tokens"].shape
        self.routing, self.routes, self.force = routing, routes, force
        self.captured = torch.full((B, Tn, routing.layers, routing.top_k), -1, dtype=torch.int16)

    @contextlib.contextmanager
    def call(self, src: torch.Tensor, n: int, group=None):
        valid = src >= 0
        ref = None
        if self.routes is not None:
            ref = torch.full((n, self.routing.layers, self.routing.top_k), -1, dtype=torch.int16)
            ref[src[valid].cpu()] = self.routes[valid].to("cpu", torch.int16)  # a shared prompt: its rows agree
        counts = self._counts()
        with self.routing.call(ref, force=self.force):
            yield
        self.captured[valid.cpu()] = self.routing.used[src[valid].cpu()]
        if group is not None:
            self._merge(group, counts)

    def _counts(self) -> torch.Tensor:
        r = self.routing
        return torch.cat([r.agree, r.counted[None], r.all_agree[None]])

    def _merge(self, group, before: torch.Tensor) -> None:
        """The cp ranks' slices merged: each position was captured by one rank (−1 on the others: the max), the
        agreement counts this call added summed — one all-reduce each."""
        import torch.distributed as dist

        captured = self.captured.int()
        dist.all_reduce(captured, op=dist.ReduceOp.MAX, group=group)
        self.captured = captured.to(torch.int16)
        added = self._counts() - before
        dist.all_reduce(added, group=group)
        now, r = before + added, self.routing
        r.agree, r.counted, r.all_agree = now[:-2], now[-2], now[-1]


def _call(replay: RouteReplay | None, src: torch.Tensor, n: int, group=None):
    return contextlib.nullcontext() if replay is None else replay.call(src, n, group)


def _head_out(model, fused: bool, **kw):
    """``model(**kw)``; ``fused``: its head skipped — ``.logits`` are the hidden states the head reads."""
    if not fused:
        return model(**kw)
    with head_skipped(model):
        return model(**kw)


def _lp_ent(model, x: torch.Tensor, targets: torch.Tensor, temperature: float, fused: bool):
    """Token log-probs and entropies of ``targets`` from ``x``: the logits ``[..., V]``, or — ``fused`` — the hidden
    states ``[..., H]`` through the head chunk by chunk (:func:`hyperrl.transforms.head_logprobs_and_entropy`)."""
    if not fused:
        return T.logprobs_and_entropy(x, targets, temperature)
    hw = head_weights(model)
    return T.head_logprobs_and_entropy(x, hw.weight, targets, temperature, bias=hw.bias, compute_dtype=hw.dtype,
                                       masks=hw.masks)


def _vision_inputs(model, batch: TensorDict, ids: torch.Tensor, attn: torch.Tensor, rows=None) -> dict:
    """A vision-language model's extra inputs for ``ids [B', T']`` (``batch``'s rows ``rows``, all when None): the
    rows' images and M-RoPE ``position_ids [3, B', T']`` (:func:`hyperrl.multimodal.forward_inputs` — the rollout
    engine's prefill computes them the same way); ``{}`` for a text model (a batch with images then is an error)."""
    spec = vision_spec(model)
    has = "image_grid_thw" in batch.keys()
    if spec is None:
        if has and bool(row_patches(batch["image_grid_thw"]).any()):
            raise VisionError(f"image_grid_thw: the batch has images but {type(model).__name__} is a text-only model; "
                              "train a vision-language model (model.vision) or drop the images")
        return {}
    vis = None
    if has:
        vis = {k: batch[k] if rows is None else batch[k][rows] for k in ("pixel_values", "image_grid_thw")}
    return forward_inputs(model, spec, ids, attn.long(), vis)


def _text_only(batch: TensorDict, model, who: str, fix: str) -> None:
    """Refuse a forward that does not carry images for a vision-language model."""
    if vision_spec(model) is not None:
        raise VisionError(f"{who} does not run vision-language models yet ({type(model).__name__}); {fix}")


def _first_action(act: torch.Tensor) -> int:
    """The batch's first action position (≥ 1: position 0 predicts nothing); ``act`` has an action."""
    return max(int(act.int().argmax(-1)[act.any(-1)].min()), 1)


def plain_logprobs_and_entropy(model, batch: TensorDict, temperature: float, replay: RouteReplay | None = None, *,
                               fused: bool = False):
    """``log π(tokens[b, t] | tokens[b, :t])`` and the entropy there, ``[B, T]`` each (0 before the
    first action position of the batch, ``a``). Logits are computed only on the action window —
    positions ``a − 1 … T − 2`` (``logits_to_keep``), not at every prompt position: at a real
    vocabulary the ``[B, T, V]`` prompt logits dominate a forward's memory. ``fused``: not even there — the head
    fused with the log-prob (:func:`hyperrl.models.head.fusable_head` must hold; every forward here takes it)."""
    tokens = batch["tokens"]  # the last token predicts nothing: run T − 1 positions
    act = batch["action_mask"]
    if tokens.shape[1] < 2 or not bool(act[:, 1:].any()):
        z = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return z, z.clone()
    a = _first_action(act)
    B, W = tokens.shape[0], tokens.shape[1] - 1
    src = torch.nn.functional.pad(torch.arange(B * W, device=tokens.device).view(B, W), (0, 1), value=-1)
    kw = _vision_inputs(model, batch, tokens[:, :-1], batch["attention_mask"][:, :-1])
    with _call(replay, torch.where(batch["attention_mask"].bool(), src, -1), B * W):
        logits = _head_out(model, fused, input_ids=tokens[:, :-1],
                           attention_mask=batch["attention_mask"][:, :-1].long(),
                           logits_to_keep=tokens.shape[1] - a, **kw).logits  # [B, T − a, V]: predicts tokens a … T − 1
    lp, ent = _lp_ent(model, logits, tokens[:, a:], temperature, fused)
    pad = torch.nn.functional.pad
    return pad(lp, (a, 0)), pad(ent, (a, 0))


def plain_log_softmax(model, batch: TensorDict, temperature: float, *, fused: bool = False
                      ) -> tuple[int, torch.Tensor]:
    """The next-token log-distribution at every position from the batch's first action position ``a`` on:
    ``(a, logp [B, T − a, V])`` in fp32, ``logp[:, j]`` the distribution token ``a + j`` was drawn from (at
    ``temperature``) — one plain forward (full-vocabulary distillation). ``fused``: ``(a, hidden [B, T − a, H])``
    instead, the states the head reads (:func:`hyperrl.transforms.head_divergence` takes them with the head)."""
    tokens, act = batch["tokens"], batch["action_mask"]
    a = _first_action(act) if bool(act[:, 1:].any()) else tokens.shape[1] - 1
    kw = _vision_inputs(model, batch, tokens[:, :-1], batch["attention_mask"][:, :-1])
    logits = _head_out(model, fused, input_ids=tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1].long(),
                       logits_to_keep=tokens.shape[1] - a, **kw).logits
    return a, logits if fused else torch.log_softmax(logits.float() / temperature, -1)


def full_vocab_divergence(student, teacher, batch: TensorDict, temperature: float, divergence, *,
                          fused: bool = False) -> tuple[int, torch.Tensor]:
    """``(a, divergence(log π_s, log π_t) [B, T − a])`` between the student's and the teacher's whole next-token
    distributions from the batch's first action position ``a`` on (the teacher without autograd) — ``fused``: from
    the two models' hidden states and heads chunk by chunk (:func:`hyperrl.transforms.head_divergence`), no
    ``[B, T − a, V]`` distribution on either side."""
    a, s = plain_log_softmax(student, batch, temperature, fused=fused)
    with torch.no_grad():
        _, t = plain_log_softmax(teacher, batch, temperature, fused=fused)
    if not fused:
        return a, divergence(s, t)
    hs, ht = head_weights(student), head_weights(teacher)
    return a, T.head_divergence(s, hs.weight, t, ht.weight, divergence, temperature, bias=hs.bias,
                                teacher_bias=ht.bias, compute_dtype=hs.dtype, teacher_dtype=ht.dtype, masks=hs.masks,
                                teacher_masks=ht.masks)


def plain_sum_pi_squared(model, batch: TensorDict, temperature: float) -> torch.Tensor:
    """``Σ_v π(v | tokens[b, :t])²`` at temperature ``temperature``, token-aligned ``[B, T]`` like the
    log-probs: ``exp(logsumexp(2z) − 2·logsumexp(z))`` of the logits ``z`` — the optimal token baseline's
    variance proxy, from one plain forward, on the action window only (0 before the batch's first action
    position ``a``, as :func:`plain_logprobs_and_entropy`)."""
    tokens, act = batch["tokens"], batch["action_mask"]
    if tokens.shape[1] < 2 or not bool(act[:, 1:].any()):
        return torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    a = _first_action(act)
    kw = _vision_inputs(model, batch, tokens[:, :-1], batch["attention_mask"][:, :-1])
    logits = model(input_ids=tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1].long(),
                   logits_to_keep=tokens.shape[1] - a, **kw).logits  # [B, T − a, V]: predicts tokens a … T − 1
    z = logits.float() / temperature
    s = torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
    return torch.nn.functional.pad(s, (a, 0))


def packed_logprobs_and_entropy(model, batch: TensorDict, temperature: float, max_tokens: int = 0,
                                replay: RouteReplay | None = None, *, fused: bool = False, agree=None):
    """As :func:`plain_logprobs_and_entropy` on action positions, padding-free (MindSpeed-RL's
    remove-padding): the rows' real tokens are concatenated into sequences of at most
    ``max_tokens`` (first-fit decreasing bins, :func:`hyperrl.transforms.micro_batches_by_token_budget`;
    0 = one sequence; a longer row alone), with position ids restarting at 0 at each row and no
    attention mask — transformers then builds the block-diagonal causal mask from the position ids
    (``masking_utils.find_packed_sequence_indices``), so a row never attends to another and no
    padding token is computed. Logits only where a row predicts one of its action tokens. Rows must
    be right-padded (real tokens a prefix of the row). Returns ``[B, T]`` each, 0 off those positions.

    Cost: ``Σ_b len_b`` tokens through the linear layers (vs ``B · T`` padded); attention is
    computed over each packed sequence's full square by SDPA on CPU (the mask does not skip
    blocks), which a flash-attention varlen kernel would not.

    ``agree(n) → N``: data-parallel ranks (FSDP, expert parallelism) must make the same number of model calls, and
    the number of packed sequences depends on the data — each rank makes the most any rank makes, the extra ones on
    one token whose output is added times 0 (its backward keeps the collectives in step)."""
    tokens, attn, act = batch["tokens"], batch["attention_mask"].bool(), batch["action_mask"].bool()
    B, Tn = tokens.shape
    _text_only(batch, model, "the packed forward (optim.pack_tokens)", "set optim.pack_tokens=0")
    lengths = _right_padded(attn, "the packed forward", "use optim.pack_tokens=0")
    nxt = torch.nn.functional.pad(act[:, 1:], (0, 1))  # position t predicts an action at t + 1
    rows_, cols_ = attn.nonzero(as_tuple=True)  # row-major: the packed order
    lp_out = torch.zeros(B, Tn, dtype=torch.float32, device=tokens.device)
    ent_out = torch.zeros_like(lp_out)
    budget = max(max_tokens or int(lengths.sum()), int(lengths.max()), 1)
    calls = []
    for rows in T.micro_batches_by_token_budget(lengths, budget):
        sel = torch.isin(rows_, torch.tensor(rows, device=tokens.device))
        r, c = rows_[sel], cols_[sel]
        keep = nxt[r, c].nonzero(as_tuple=True)[0]
        if len(keep):
            calls.append((r, c, keep))
    for _ in range((agree(len(calls)) if agree is not None else len(calls)) - len(calls)):  # another rank's more
        idle = _head_out(model, fused, input_ids=tokens[rows_[:1], cols_[:1]][None], position_ids=cols_[:1][None] * 0,
                         use_cache=False).logits
        lp_out = lp_out + 0.0 * idle.float().sum()
    for r, c, keep in calls:
        src = torch.full((B, Tn), -1, dtype=torch.long, device=tokens.device)
        src[r, c] = torch.arange(len(r), device=tokens.device)
        with _call(replay, src, len(r)):
            logits = _head_out(model, fused, input_ids=tokens[r, c][None], position_ids=c[None], logits_to_keep=keep,
                               use_cache=False).logits
        lp, ent = _lp_ent(model, logits, tokens[r[keep], c[keep] + 1][None], temperature, fused)
        lp_out = lp_out.index_put((r[keep], c[keep] + 1), lp[0])
        ent_out = ent_out.index_put((r[keep], c[keep] + 1), ent[0])
    return lp_out, ent_out


def _right_padded(attn: torch.Tensor, who: str, fix: str) -> torch.Tensor:
    """The rows' lengths ``[B]``; refuses a row whose real tokens are not a prefix of it."""
    lengths = attn.sum(-1)
    if not torch.equal(attn, torch.arange(attn.shape[1], device=attn.device)[None, :] < lengths[:, None]):
        raise ValueError(f"attention_mask: {who} needs right-padded rows (real tokens a prefix of each row); {fix}")
    return lengths


def context_parallel_logprobs_and_entropy(model, batch: TensorDict, temperature: float, group, *,
                                          packed: bool = False, fused: bool = False, replay: RouteReplay | None = None):
    """As :func:`plain_logprobs_and_entropy` on action positions, with each rank of the context-parallel
    ``group`` (``cp`` ranks, the same ``batch`` on each) running its slice of every sequence
    (:mod:`hyperrl.distributed.context_parallel`: Ulysses or ring attention over the whole sequence; ``model``
    switched by :func:`~hyperrl.distributed.context_parallel.context_parallel`). Each rank computes the
    logits, log-probs and entropies of its slice only — ``[B, T/cp, V]``, the forward's largest tensor —
    and the ``[B, T]`` results are gathered (differentiable: the backward reduce-scatters, summing the
    ``cp`` ranks' identical losses' gradients). ``packed``: the rows' real tokens concatenated into one
    sequence (positions restarting at 0, attention within each row; :func:`packed_logprobs_and_entropy`'s
    padding-free forward), exactly one model call — ranks stay in step. Rows must be right-padded. ``replay``: a
    mixture of experts' routes (:class:`RouteReplay`), sliced with the sequence — each rank replays / captures its
    own tokens' and the captures are merged over ``group``; the call's ``attention_mask`` marks its real tokens
    (the attention ignores it — the mask is built over the whole sequence — but a :class:`~hyperrl.models.RouterTap`
    reads it)."""
    from hyperrl.distributed.context_parallel import (
        gather_sequence,
        layout_index,
        sequence_layout,
        split_sequence,
    )

    tokens, attn = batch["tokens"], batch["attention_mask"].bool()
    B, Tn = tokens.shape
    _text_only(batch, model, "context parallelism (run.cp)", "set run.cp=1")
    _right_padded(attn, "context parallelism (run.cp)", "rows are right-padded by the collectors — check custom ones")
    cp, r = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    pad = torch.nn.functional.pad
    if packed:
        rows, cols = attn.nonzero(as_tuple=True)  # row-major: the packed order
        ids, pos, seg = tokens[rows, cols][None], cols[None], rows[None]
    else:  # position t predicts token t + 1: run the first T − 1
        ids, pos, seg = tokens[:, :-1], None, None
    N = ids.shape[1]
    layout = sequence_layout(model)  # contiguous slices (Ulysses) or zigzag (ring attention)
    local, lpos, Np = split_sequence(ids, group, position_ids=pos, layout=layout)
    mine = layout_index(Np, cp, layout, tokens.device)[r]  # this rank's positions of the (packed) sequence
    targets = pad(ids[:, 1:] if packed else tokens[:, 1:], (0, Np - N + (1 if packed else 0)))[:, mine]
    # packed: the segment ids reach the attention as a keyword argument (gradient checkpointing's recompute too)
    seg_kw = {"cp_segments": pad(seg, (0, Np - N), value=B)} if packed else {}
    real, src = _slice_tokens(attn, mine, N, Np, (rows, cols) if packed else None)
    with _call(replay, src, local.numel(), group):
        logits = _head_out(model, fused, input_ids=local, position_ids=lpos, attention_mask=real.long(),
                           use_cache=False, **seg_kw).logits  # [B, n, V]
    lp, ent = _lp_ent(model, logits, targets, temperature, fused)
    lp, ent = gather_sequence(lp, group, N, layout), gather_sequence(ent, group, N, layout)
    if not packed:
        return pad(lp, (1, 0)), pad(ent, (1, 0))
    same = torch.cat([rows[1:] == rows[:-1], rows.new_zeros(1, dtype=torch.bool)])  # predicts its own row's next
    zero = torch.zeros(B, Tn, dtype=lp.dtype, device=tokens.device)
    where = (rows[same], cols[same] + 1)
    return zero.index_put(where, lp[0][same]), zero.index_put(where, ent[0][same])


def _slice_tokens(attn: torch.Tensor, mine: torch.Tensor, N: int, Np: int, packed: tuple | None):
    """A context-parallel call's tokens: ``real [b, n]`` — which of this rank's ``n`` positions ``mine`` (of a
    sequence of ``N`` padded to ``Np``, cut in ``cp`` slices) are real tokens — and ``src [B, T]``, each batch
    position's index among the call's ``b · n`` tokens (−1: another rank's, padding). ``packed = (rows, cols)``: the
    one packed sequence's batch positions (``b = 1``); else the rows' first ``T − 1`` positions (``b = B``)."""
    B, Tn = attn.shape
    held = mine < N  # positions of the sequence (not the padding to a multiple of cp)
    j = held.nonzero(as_tuple=True)[0]
    src = torch.full((B, Tn), -1, dtype=torch.long, device=attn.device)
    if packed is not None:
        rows, cols = packed
        src[rows[mine[j]], cols[mine[j]]] = j
        return held[None], src
    src[:, mine[j]] = torch.arange(B, device=attn.device)[:, None] * len(mine) + j[None]
    real = torch.nn.functional.pad(attn[:, :-1], (0, Np - N))[:, mine]
    return real, torch.where(attn, src, -1)


def context_parallel_values(critic, batch: TensorDict, group) -> torch.Tensor:
    """The critic's token-aligned values ``[B, T]`` (:class:`~hyperrl.models.critic.ValueModel`: ``values[:, t]``
    read at position ``t − 1``, ``values[:, 0] = 0``) with each rank of the context-parallel ``group`` running its
    slice of every sequence (the critic's backbone switched by
    :func:`~hyperrl.distributed.context_parallel.context_parallel`, as the policy's): each rank reads the values of
    its slice ``[B, T/cp]``, gathered (differentiable, as :func:`context_parallel_logprobs_and_entropy`). Rows must be
    right-padded."""
    from hyperrl.distributed.context_parallel import gather_sequence, sequence_layout, split_sequence

    tokens, attn = batch["tokens"], batch["attention_mask"].bool()
    _right_padded(attn, "context parallelism (run.cp)", "rows are right-padded by the collectors — check custom ones")
    layout = sequence_layout(critic.backbone)
    local, lpos, _ = split_sequence(tokens[:, :-1], group, layout=layout)
    v = critic(input_ids=local, position_ids=lpos, use_cache=False)  # [B, n]
    return torch.nn.functional.pad(gather_sequence(v, group, tokens.shape[1] - 1, layout), (1, 0))


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
    kw = _vision_inputs(model, batch, pre_ids, pre_mask, first)  # a VLM: the prompts' images, M-RoPE positions
    if "position_ids" in kw:
        pre_pos = kw.pop("position_ids")  # [3, U, P]
    Tn = tokens.shape[1]
    t = torch.arange(Tn, device=dev)[None, :]
    src = torch.where(t < p[:, None], inverse[:, None] * P + (P - p[:, None]) + t, -1)  # row b's prompt in its u
    with _call(replay, src, len(first) * P):
        out = _head_out(model, fused, input_ids=pre_ids, attention_mask=pre_mask.long(), position_ids=pre_pos,
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
    lp, ent = _lp_ent(model, logits, cont, temperature, fused)
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
        with _call(replay, src, len(u) * w):
            out = _head_out(model, fused, input_ids=ids, attention_mask=torch.cat([pre_mask[u], ok], 1).long(),
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


def policy_logprobs(model, batch: TensorDict, temperature: float, *, shared_prefix: bool = True, agree=None,
                    replay: RouteReplay | None = None, fused: bool = False):
    """Token-aligned log-probs and entropies ``[B, T]``: the shared-prefix forward when it is cheaper
    (:func:`choose`), else the plain forward. ``agree((use, S)) → (use, S)`` makes the choice
    collective (data parallel: every rank then makes the same model calls — all use the
    shared path only if all prefer it, and run the continuation if any rank has one)."""
    use, S, groups = choose(batch, shared_prefix)
    if agree is not None:
        use, S = agree(use, S)
    if use:  # an agreed `use` implies this rank preferred it too, so its groups exist
        return shared_prefix_logprobs_and_entropy(model, batch, temperature, groups, min_rest=int(S > 1),
                                                  replay=replay, fused=fused, bucket=agree is None)
    return plain_logprobs_and_entropy(model, batch, temperature, replay, fused=fused)
