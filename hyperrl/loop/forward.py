"""Policy forwards: token-aligned log-probs and entropies of a trajectory batch under a causal LM.

Two ways to the same numbers (up to float rounding):

* :func:`plain_logprobs_and_entropy` — one forward over every padded row ``[B, T]`` (and its packed and
  context-parallel forms here);
* :func:`~hyperrl.loop.shared_prefix.shared_prefix_logprobs_and_entropy` — each distinct prompt run once, its KV
  cache indexed out to its rows, only the tokens after the prompt run per row (:mod:`hyperrl.loop.shared_prefix`).

:func:`policy_logprobs` picks the cheaper of the two by their token counts (:func:`~hyperrl.loop.shared_prefix.choose`).
Output positions ``t ≤ prefix`` (the prompt) and padding are 0 in the shared-prefix path; only action positions
are meaningful in either (every consumer masks by ``action_mask``). What every forward shares — a model call with
routing replay, log-probs from its output, a VLM's inputs — is :mod:`hyperrl.loop.model_calls`'.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hyperrl import transforms as T
from hyperrl.loop.model_calls import RouteReplay, first_action, head_out, lp_ent, route_call, text_only, vision_inputs
from hyperrl.loop.shared_prefix import choose, prefix_groups, shared_prefix_logprobs_and_entropy
from hyperrl.models.head import head_weights

__all__ = ["plain_logprobs_and_entropy", "shared_prefix_logprobs_and_entropy", "packed_logprobs_and_entropy",
           "context_parallel_logprobs_and_entropy", "context_parallel_values", "policy_logprobs",
           "prefix_groups", "choose", "RouteReplay", "full_vocab_divergence"]


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
    a = first_action(act)
    B, W = tokens.shape[0], tokens.shape[1] - 1
    src = torch.nn.functional.pad(torch.arange(B * W, device=tokens.device).view(B, W), (0, 1), value=-1)
    kw = vision_inputs(model, batch, tokens[:, :-1], batch["attention_mask"][:, :-1])
    with route_call(replay, torch.where(batch["attention_mask"].bool(), src, -1), B * W):
        logits = head_out(model, fused, input_ids=tokens[:, :-1],
                          attention_mask=batch["attention_mask"][:, :-1].long(),
                          logits_to_keep=tokens.shape[1] - a, **kw).logits  # [B, T − a, V]: predicts tokens a … T − 1
    lp, ent = lp_ent(model, logits, tokens[:, a:], temperature, fused)
    pad = torch.nn.functional.pad
    return pad(lp, (a, 0)), pad(ent, (a, 0))


def plain_log_softmax(model, batch: TensorDict, temperature: float, *, fused: bool = False
                      ) -> tuple[int, torch.Tensor]:
    """The next-token log-distribution at every position from the batch's first action position ``a`` on:
    ``(a, logp [B, T − a, V])`` in fp32, ``logp[:, j]`` the distribution token ``a + j`` was drawn from (at
    ``temperature``) — one plain forward (full-vocabulary distillation). ``fused``: ``(a, hidden [B, T − a, H])``
    instead, the states the head reads (:func:`hyperrl.transforms.head_divergence` takes them with the head)."""
    tokens, act = batch["tokens"], batch["action_mask"]
    a = first_action(act) if bool(act[:, 1:].any()) else tokens.shape[1] - 1
    kw = vision_inputs(model, batch, tokens[:, :-1], batch["attention_mask"][:, :-1])
    logits = head_out(model, fused, input_ids=tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1].long(),
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
    a = first_action(act)
    kw = vision_inputs(model, batch, tokens[:, :-1], batch["attention_mask"][:, :-1])
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
    text_only(batch, model, "the packed forward (optim.pack_tokens)", "set optim.pack_tokens=0")
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
        idle = head_out(model, fused, input_ids=tokens[rows_[:1], cols_[:1]][None], position_ids=cols_[:1][None] * 0,
                        use_cache=False).logits
        lp_out = lp_out + 0.0 * idle.float().sum()
    for r, c, keep in calls:
        src = torch.full((B, Tn), -1, dtype=torch.long, device=tokens.device)
        src[r, c] = torch.arange(len(r), device=tokens.device)
        with route_call(replay, src, len(r)):
            logits = head_out(model, fused, input_ids=tokens[r, c][None], position_ids=c[None], logits_to_keep=keep,
                              use_cache=False).logits
        lp, ent = lp_ent(model, logits, tokens[r[keep], c[keep] + 1][None], temperature, fused)
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
    text_only(batch, model, "context parallelism (run.cp)", "set run.cp=1")
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
    with route_call(replay, src, local.numel(), group):
        logits = head_out(model, fused, input_ids=local, position_ids=lpos, attention_mask=real.long(),
                          use_cache=False, **seg_kw).logits  # [B, n, V]
    lp, ent = lp_ent(model, logits, targets, temperature, fused)
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
