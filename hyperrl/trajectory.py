"""The trajectory contract: a token-first TensorDict batch of ``B`` sequences.

Layout (``B`` sequences, ``T`` padded length; every sequence is *right-padded*: its valid
tokens are ``tokens[b, :L_b]`` and ``attention_mask[b]`` is ``1…1 0…0``):

============================  ===========  ========  =============================================
key                           shape        dtype     meaning
============================  ===========  ========  =============================================
``tokens``                    ``[B, T]``   int64     the rollout's own token ids (prompt, response,
                                                     tool/observation tokens), never re-tokenised
``attention_mask``            ``[B, T]``   bool      1 on real tokens, 0 on padding
``action_mask``               ``[B, T]``   bool      1 only on tokens the policy generated (incl.
                                                     the EOS it sampled); 0 on prompt, observation,
                                                     tool output and padding
``rollout_logprobs``          ``[B, T]``   float32   log-prob the rollout engine sampled each
                                                     action token with (0 off the action mask)
``policy_version``            ``[B]``      int64     version of the weights that generated it
``group_id``                  ``[B]``      int64     prompt group: the n samples of a prompt share it
``reward``                    ``[B]``      float32   scalar (outcome) reward per sequence
optional: ``token_rewards``,  ``[B, T]``   float32   per-token reward / critic value / behaviour,
``values``, ``old_logprobs``,                        reference log-probs, advantages, returns
``ref_logprobs``,
``advantages``, ``returns``
optional: ``sum_pi_squared``  ``[B, T]``   float32   Σ_v π_v² of the behaviour policy's distribution at each
                                                     action token (the optimal token baseline's variance proxy)
optional: ``m2po_keep``       ``[B, T]``   bool      M2PO's step-wide keep-mask (set when the batch is prepared)
optional: ``tool_calls``      ``[B]``      int64     tool calls the environment ran in the episode
optional: ``token_version``   ``[B, T]``   int64     weight version that sampled each action token;
                                                     ``NO_VERSION`` (−1) on prompt / observation
                                                     tokens; padding ignored (docs/async.md)
optional: ``kv_version``      ``[B, T]``   int64     oldest weight version among the keys / values each
                                                     action token was sampled from (= its
                                                     ``token_version`` unless a cache was kept across a
                                                     publication: ``async.kv_cache: keep``); NO_VERSION
                                                     elsewhere
optional: ``sample_uid``      ``[B]``      int64     unique id of the sample over the run
optional: ``finish_reason``   ``[B]``      int64     0 stop, 1 length, 2 aborted (``FINISH_REASONS``)
optional: ``final_turn``      ``[B]``      int64     index of the first token of the row's last action turn:
                                                     the configured rewards score that final response only
optional: ``routed_experts``  ``[B, T, L,   int16     mixture of experts: the ``k`` experts each token was
                              k]``                   routed to in each of the ``L`` MoE layers by the
                                                     forward that processed it in the rollout (prompt
                                                     tokens from the prefill); −1 where none did (a
                                                     row's last token, padding). Routing replay
                                                     (``algo.routing_replay``, docs/moe.md) reads it
optional: ``old_routed_        ``[B, T, L,   int16     the routes of the trainer's own old-log-prob pass
experts``                     k]``                   (R2 replays them in the update)
============================  ===========  ========  =============================================

A row's ``policy_version`` is its *oldest* action token's version when ``token_version`` is
present (a request resumed across a publication spans several versions).

**Alignment convention (used everywhere in hyperrl).** Every per-token field is aligned with
the *token it describes*: ``logprobs[b, t] = log π(tokens[b, t] | tokens[b, :t])``, and likewise
``values[b, t]``, ``advantages[b, t]``, ``token_rewards[b, t]`` belong to the action that emitted
``tokens[b, t]``. A model's ``logits[:, t]`` predict token ``t + 1``, so logits are shifted by one
before use (:func:`hyperrl.transforms.sequence_logprobs` does this). Position 0 is never an
action (a sequence starts with at least one prompt token).

The packed (padding-free) layout concatenates the valid tokens of all sequences:
``to_packed(batch)`` returns a TensorDict with sub-dicts ``token`` (batch ``[N]``) and ``seq``
(batch ``[B]``) and ``cu_seqlens`` ``[B + 1]``; ``from_packed`` inverts it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from hyperrl.errors import HyperRLError

__all__ = [
    "stack_episodes",
    "cat_batches",
    "trim_padding",
    "real_extent",
    "TOKEN_FIELDS",
    "SEQ_FIELDS",
    "VISION_FIELDS",
    "check_vision",
    "REQUIRED",
    "TrajectoryError",
    "make_trajectory",
    "validate",
    "to_packed",
    "from_packed",
    "sequence_lengths",
    "response_lengths",
    "NO_VERSION",
    "FINISH_REASONS",
]

NO_VERSION = -1  # token_version of tokens no policy sampled (prompt, observation, tool output)
FINISH_REASONS = ("stop", "length", "aborted")  # finish_reason codes 0, 1, 2


@dataclass(frozen=True)
class _Field:
    dtype: torch.dtype
    per_token: bool
    required: bool
    finite: bool = False
    trailing: int = 0  # per-token fields with more dims than [B, T] (routed_experts: [B, T, L, k])


_F32 = torch.float32
FIELDS: dict[str, _Field] = {
    "tokens": _Field(torch.int64, True, True),
    "attention_mask": _Field(torch.bool, True, True),
    "action_mask": _Field(torch.bool, True, True),
    "rollout_logprobs": _Field(_F32, True, True, finite=True),
    "policy_version": _Field(torch.int64, False, True),
    "group_id": _Field(torch.int64, False, True),
    "reward": _Field(_F32, False, True, finite=True),
    "token_rewards": _Field(_F32, True, False, finite=True),
    "values": _Field(_F32, True, False, finite=True),
    "old_logprobs": _Field(_F32, True, False, finite=True),
    "ref_logprobs": _Field(_F32, True, False, finite=True),
    "sum_pi_squared": _Field(_F32, True, False, finite=True),
    "m2po_keep": _Field(torch.bool, True, False),
    "advantages": _Field(_F32, True, False, finite=True),
    "returns": _Field(_F32, True, False, finite=True),
    "tool_calls": _Field(torch.int64, False, False),
    "token_version": _Field(torch.int64, True, False),
    "kv_version": _Field(torch.int64, True, False),
    "sample_uid": _Field(torch.int64, False, False),
    "finish_reason": _Field(torch.int64, False, False),
    "final_turn": _Field(torch.int64, False, False),
    "routed_experts": _Field(torch.int16, True, False, trailing=2),
    "old_routed_experts": _Field(torch.int16, True, False, trailing=2),
}
TOKEN_FIELDS = tuple(k for k, f in FIELDS.items() if f.per_token)
SEQ_FIELDS = tuple(k for k, f in FIELDS.items() if not f.per_token)
REQUIRED = tuple(k for k, f in FIELDS.items() if f.required)

_HINTS = {
    "group_id": "give each sequence the integer id of its prompt group (the n samples of one prompt share it)",
    "policy_version": "record the weight version the rollout engine served when it generated the sequence",
    "rollout_logprobs": "request the sampled-token log-probs from the rollout engine (fp32)",
}


class TrajectoryError(HyperRLError, ValueError):
    """A batch violates the trajectory contract; the message names the field and the fix."""


def make_trajectory(**fields: torch.Tensor) -> TensorDict:
    """Build a trajectory TensorDict, casting masks to bool and float fields to fp32, then validate."""
    out = {}
    for key, value in fields.items():
        value = torch.as_tensor(value)
        spec = FIELDS.get(key)
        if spec is not None and value.dtype != spec.dtype:
            if spec.dtype == torch.bool and value.dtype.is_floating_point:
                raise TrajectoryError(f"{key}: expected a 0/1 mask, got dtype {value.dtype}")
            ints = spec.dtype in (torch.int64, torch.int16)
            if ints and (value.dtype.is_floating_point or value.dtype == torch.bool):
                raise TrajectoryError(f"{key}: dtype {value.dtype}, expected integers ({spec.dtype})")
            if spec.dtype == torch.float32 and not value.dtype.is_floating_point:
                raise TrajectoryError(f"{key}: dtype {value.dtype}, expected floating point (stored as float32)")
            value = value.to(spec.dtype)
        out[key] = value
    if "tokens" not in out or out["tokens"].dim() != 2:
        raise TrajectoryError("tokens: missing or not [B, T]; a trajectory needs token ids [B, T]")
    _check_shapes(out, *out["tokens"].shape)
    batch = TensorDict(out, batch_size=[out["tokens"].shape[0]])
    validate(batch)
    return batch


def _fail(key: str, msg: str) -> None:
    raise TrajectoryError(f"{key}: {msg}")


def _check_shapes(fields, B: int, T: int) -> None:
    for key, v in fields.items():
        spec = FIELDS.get(key)
        if spec is None:
            continue
        want = (B, T) if spec.per_token else (B,)
        if tuple(v.shape[:len(want)]) != want or v.dim() != len(want) + spec.trailing:
            what = "[B, T, L, k]" if spec.trailing else "[B, T]" if spec.per_token else "[B]"
            dims = ", ".join([str(d) for d in want] + ["…"] * spec.trailing)
            _fail(key, f"shape {list(v.shape)}, expected [{dims}] ({what})")


def validate(batch: TensorDict, *, single_version: bool = False, required: tuple[str, ...] = REQUIRED,
             learner_version: int | None = None, max_staleness: int | None = None, image_token_id: int | None = None,
             merge: int = 2) -> None:
    """Check ``batch`` against the contract; raise :class:`TrajectoryError` naming the field.

    Checks: non-empty batch; required keys present; shapes ``[B, T]`` / ``[B]``; dtypes;
    finite rewards, log-probs and other float fields; right padding; action mask only on real
    tokens and never at position 0; log-probs ``≤ 0`` on actions; with ``single_version`` all
    sequences from one policy version. The asynchronous fields when present (docs/async.md):
    ``token_version`` ``≥ 0`` on actions and ``NO_VERSION`` on the other real tokens,
    ``policy_version`` = the oldest action token's version, unique ``sample_uid``, a known
    ``finish_reason``; with ``learner_version`` and ``max_staleness`` no action token staler than η. With
    ``image_token_id`` (a vision-language model's placeholder) and vision inputs in the batch, every row's
    placeholders against its grids (:func:`check_vision`).
    """
    if not isinstance(batch, TensorDict):
        raise TrajectoryError(f"batch: expected a TensorDict, got {type(batch).__name__}")
    if batch.batch_dims != 1:
        _fail("batch", f"batch_size must be [B], got {list(batch.batch_size)}")
    B = batch.batch_size[0]
    if B == 0:
        _fail("batch", "empty batch (B = 0): nothing to train on; filter upstream or skip the step")
    for key in required:
        if key not in batch.keys():
            _fail(key, "missing" + (f"; {_HINTS[key]}" if key in _HINTS else ""))
    if "tokens" not in batch.keys():
        _fail("tokens", "missing")
    if batch["tokens"].dim() != 2:
        _fail("tokens", f"shape {list(batch['tokens'].shape)}, expected [B, T]")
    T = batch["tokens"].shape[-1]
    _check_shapes(batch, B, T)
    for key in batch.keys():
        spec = FIELDS.get(key)
        if spec is None:
            continue
        v = batch[key]
        if v.dtype != spec.dtype:
            _fail(key, f"dtype {v.dtype}, expected {spec.dtype}")
        if spec.finite and not bool(torch.isfinite(v).all()):
            bad = (~torch.isfinite(v)).nonzero()[0].tolist()
            _fail(key, f"contains NaN/inf (first at index {bad}); fix the producer, values must be finite")
    attn, act = batch["attention_mask"], batch["action_mask"]
    lengths = attn.sum(-1)
    ar = torch.arange(T)
    if not bool((attn == (ar[None, :] < lengths[:, None])).all()):
        row = int((attn != (ar[None, :] < lengths[:, None])).any(-1).nonzero()[0])
        _fail("attention_mask", f"sequence {row} is not right-padded (expected 1…1 0…0); shift its tokens left")
    if bool((act & ~attn).any()):
        row = int((act & ~attn).any(-1).nonzero()[0])
        _fail("action_mask", f"set on padding in sequence {row}; actions must lie where attention_mask is 1")
    if T > 0 and bool(act[:, 0].any()):
        _fail("action_mask", "set at position 0; a sequence must start with at least one prompt token")
    if "routed_experts" in batch.keys() and bool((batch["routed_experts"] < -1).any()):
        b, t = (batch["routed_experts"] < -1).flatten(2).any(-1).nonzero()[0].tolist()
        _fail("routed_experts", f"token [{b}, {t}] has a negative expert id other than −1 (no route)")
    lp = batch["rollout_logprobs"]
    if bool((lp[act] > 1e-6).any()):
        _fail("rollout_logprobs", "positive log-prob on an action token; pass log-probs, not probabilities")
    if single_version:
        versions = torch.unique(batch["policy_version"]).tolist()
        if len(versions) > 1:
            _fail("policy_version", f"mixed versions {versions} where one is required; regenerate or drop stale ones")
    _validate_async(batch, learner_version, max_staleness)
    if image_token_id is not None and VISION_FIELDS & set(batch.keys()):
        check_vision(batch, image_token_id=image_token_id, merge=merge)


def check_vision(batch, *, image_token_id: int, merge: int = 2) -> None:
    """Each row's image placeholder tokens (``tokens == image_token_id`` inside ``attention_mask``) number
    ``Σ t·h·w / merge²`` of its grids, and its patches fit ``pixel_values``; a :class:`TrajectoryError` names the first
    row that disagrees."""
    for k in ("pixel_values", "image_grid_thw"):
        if k not in batch.keys():
            raise TrajectoryError(f"{k}: missing (a multimodal batch carries pixel_values and image_grid_thw per row)")
    grids = batch["image_grid_thw"]
    if grids.dim() != 3 or grids.shape[-1] != 3:
        raise TrajectoryError(f"image_grid_thw: shape {tuple(grids.shape)}, expected [B, I, 3]")
    merged = grids.long().prod(-1)  # each image's patches [B, I]
    counts = merged.sum(-1)
    if bool((merged % (merge * merge)).any()):
        b = int((merged % (merge * merge)).any(-1).nonzero()[0])
        raise TrajectoryError(f"image_grid_thw: row {b}: {grids[b].tolist()} has a grid whose t·h·w is not a "
                              f"multiple of merge² = {merge * merge}")
    placeholders = ((batch["tokens"] == image_token_id) & batch["attention_mask"].bool()).sum(-1)
    want = counts // (merge * merge)
    bad = (placeholders != want.to(placeholders.device)).nonzero()
    if len(bad):
        b = int(bad[0])
        raise TrajectoryError(f"image_grid_thw: row {b}: {int(placeholders[b])} image placeholder tokens (id "
                              f"{image_token_id}) but its image_grid_thw {grids[b][merged[b] > 0].tolist()} takes "
                              f"{int(want[b])}")
    if counts.numel() and int(counts.max()) > batch["pixel_values"].shape[1]:
        b = int((counts > batch["pixel_values"].shape[1]).nonzero()[0])
        raise TrajectoryError(f"pixel_values: row {b}: its grids need {int(counts[b])} patches, pixel_values holds "
                              f"{batch['pixel_values'].shape[1]} a row")


def _validate_async(batch: TensorDict, learner_version: int | None, max_staleness: int | None) -> None:
    keys = set(batch.keys())
    if "sample_uid" in keys:
        uid = batch["sample_uid"]
        if bool((uid < 0).any()):
            _fail("sample_uid", f"negative id {int(uid[uid < 0][0])}; ids are ≥ 0")
        u, counts = torch.unique(uid, return_counts=True)
        if bool((counts > 1).any()):
            dup = int(u[counts > 1][0])
            rows = (uid == dup).nonzero()[:, 0].tolist()
            _fail("sample_uid", f"duplicate id {dup} at rows {rows}; a sample must be trained once")
    if "finish_reason" in keys:
        fr = batch["finish_reason"]
        bad = (fr < 0) | (fr >= len(FINISH_REASONS))
        if bool(bad.any()):
            _fail("finish_reason", f"code {int(fr[bad][0])} at row {int(bad.nonzero()[0])}; one of "
                  f"{dict(enumerate(FINISH_REASONS))}")
    if "token_version" not in keys:
        if max_staleness is not None:
            _fail("token_version", "missing; a staleness bound needs the version of every action token")
        return
    tv, act, attn = batch["token_version"], batch["action_mask"], batch["attention_mask"]
    if bool((act & (tv < 0)).any()):
        b, t = (act & (tv < 0)).nonzero()[0].tolist()
        _fail("token_version", f"action token [{b}, {t}] has no version ({int(tv[b, t])}); the engine must stamp "
              "every sampled token with the version it served")
    other = attn & ~act & (tv != NO_VERSION)
    if bool(other.any()):
        b, t = other.nonzero()[0].tolist()
        _fail("token_version", f"token [{b}, {t}] is not an action but carries version {int(tv[b, t])}; prompt and "
              f"observation tokens carry NO_VERSION ({NO_VERSION})")
    big = torch.iinfo(torch.int64).max
    oldest = torch.where(act, tv, big).min(-1).values
    rows = act.any(-1)
    wrong = rows & (oldest != batch["policy_version"])
    if bool(wrong.any()):
        r = int(wrong.nonzero()[0])
        _fail("policy_version", f"row {r} says {int(batch['policy_version'][r])} but its oldest action token was "
              f"sampled at {int(oldest[r])}; policy_version is the oldest token's version")
    if "kv_version" in keys:
        kv = batch["kv_version"]
        bad = act & ((kv < 0) | (kv > tv))
        if bool(bad.any()):
            b, t = bad.nonzero()[0].tolist()
            _fail("kv_version", f"action token [{b}, {t}] has kv_version {int(kv[b, t])} with token_version "
                  f"{int(tv[b, t])}; the cache a token is sampled from is at most as new as the token")
        if bool((attn & ~act & (kv != NO_VERSION)).any()):
            b, t = (attn & ~act & (kv != NO_VERSION)).nonzero()[0].tolist()
            _fail("kv_version", f"token [{b}, {t}] is not an action but carries kv_version {int(kv[b, t])}")
    if max_staleness is not None:
        if learner_version is None:
            raise ValueError("validate: max_staleness needs learner_version")
        if bool((act & (tv > learner_version)).any()):
            b, t = (act & (tv > learner_version)).nonzero()[0].tolist()
            _fail("token_version", f"token [{b}, {t}] was sampled at version {int(tv[b, t])}, newer than the "
                  f"learner's {learner_version}")
        stale = act & (learner_version - tv > max_staleness)
        if bool(stale.any()):
            b, t = stale.nonzero()[0].tolist()
            _fail("token_version", f"token [{b}, {t}] was sampled at version {int(tv[b, t])}: "
                  f"{learner_version - int(tv[b, t])} versions stale at learner version {learner_version}, over "
                  f"async.max_staleness={max_staleness}")


def sequence_lengths(batch: TensorDict) -> torch.Tensor:
    """Valid tokens per sequence ``[B]`` (int64)."""
    return batch["attention_mask"].sum(-1)


def response_lengths(batch: TensorDict) -> torch.Tensor:
    """Policy-generated tokens per sequence ``|o_i| = Σ_t m`` ``[B]`` (int64)."""
    return batch["action_mask"].sum(-1)


def to_packed(batch: TensorDict) -> TensorDict:
    """Padding-free layout: concatenate the valid tokens of every sequence.

    Returns a TensorDict (batch ``[]``) with ``token`` (per-token fields, batch ``[N]``,
    ``N = Σ_b L_b``), ``seq`` (per-sequence fields, batch ``[B]``), ``cu_seqlens`` ``[B + 1]``
    and ``max_len`` (the padded ``T``, so :func:`from_packed` restores the width).
    """
    attn = batch["attention_mask"]
    B, T = attn.shape
    lengths = attn.sum(-1)
    cu = torch.zeros(B + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    token = {k: v[attn] for k, v in batch.items() if v.dim() >= 2 and tuple(v.shape[:2]) == (B, T)}
    seq = {k: v for k, v in batch.items() if k not in token}
    return TensorDict(
        {
            "token": TensorDict(token, batch_size=[int(cu[-1])]),
            "seq": TensorDict(seq, batch_size=[B]),
            "cu_seqlens": cu,
            "max_len": torch.tensor(T),
        },
        batch_size=[],
    )


def from_packed(packed: TensorDict, pad_to: int | None = None) -> TensorDict:
    """Inverse of :func:`to_packed`: right-pad every sequence to ``pad_to`` (default ``max_len``)."""
    cu = packed["cu_seqlens"]
    B = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    T = int(packed["max_len"]) if pad_to is None else pad_to
    if B and int(lengths.max()) > T:
        raise TrajectoryError(f"pad_to: {T} is shorter than the longest sequence ({int(lengths.max())})")
    mask = torch.arange(T)[None, :] < lengths[:, None]
    out = {}
    for k, v in packed["token"].items():
        full = torch.zeros((B, T, *v.shape[1:]), dtype=v.dtype)
        full[mask] = v
        out[k] = full
    out.update(dict(packed["seq"].items()))
    return TensorDict(out, batch_size=[B])


def stack_episodes(rows: list[dict], pad_id: int = 0) -> TensorDict:
    """Right-pad episode rows into one validated trajectory batch."""
    B, T = len(rows), max(len(r["tokens"]) for r in rows)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.bool)
    act = torch.zeros(B, T, dtype=torch.bool)
    lp = torch.zeros(B, T)
    tv = torch.full((B, T), NO_VERSION, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["tokens"])
        tokens[i, :n] = torch.tensor(r["tokens"])
        attn[i, :n] = True
        act[i, :n] = torch.tensor(r["action"])
        lp[i, :n] = torch.tensor(r["logprobs"])
        if r.get("token_versions") is not None:
            tv[i, :n] = torch.tensor(r["token_versions"])
        else:
            tv[i, :n] = torch.where(act[i, :n], int(r["version"]), NO_VERSION)
    oldest = torch.where(act, tv, torch.iinfo(torch.int64).max).min(-1).values
    version = torch.tensor([r["version"] for r in rows])
    extra = {}
    if all("finish_reason" in r for r in rows):
        extra["finish_reason"] = torch.tensor([FINISH_REASONS.index(r["finish_reason"]) for r in rows])
    if all("sample_uid" in r for r in rows):
        extra["sample_uid"] = torch.tensor([r["sample_uid"] for r in rows])
    if all("final_turn" in r for r in rows):
        extra["final_turn"] = torch.tensor([r["final_turn"] for r in rows])
    if rows and all(r.get("routes") is not None for r in rows):  # [n, L, k] per row (a mixture of experts)
        re = torch.full((B, T, *rows[0]["routes"].shape[1:]), -1, dtype=torch.int16)
        for i, r in enumerate(rows):
            re[i, :len(r["routes"])] = r["routes"]
        extra["routed_experts"] = re
    return make_trajectory(tokens=tokens, attention_mask=attn, action_mask=act, rollout_logprobs=lp,
                           policy_version=torch.where(act.any(-1), oldest, version), token_version=tv,
                           group_id=torch.tensor([r["group_id"] for r in rows]),
                           reward=torch.tensor([float(r["reward"]) for r in rows]), **extra)


def real_extent(batch: TensorDict) -> torch.Tensor:
    """``[B]``: one past each row's last real token (``attention_mask``) — the width the row needs."""
    attn = batch["attention_mask"]
    return (torch.arange(1, attn.shape[1] + 1, device=attn.device) * attn).amax(-1)


def trim_padding(batch: TensorDict) -> TensorDict:
    """The batch with every token field ``[B, T]`` cut to its widest row (:func:`real_extent`): the
    padding columns no row needs are dropped (a new TensorDict; the input is not changed). Keys
    outside ``TOKEN_FIELDS`` (``[B]``, ``[B, K]`` reward components, …) are kept as they are — a
    per-token key unknown here keeps width ``T`` and fails loudly against the cut ones."""
    Tn = batch["tokens"].shape[1]
    width = int(real_extent(batch).max()) if batch.batch_size[0] else 0
    if width == Tn:
        return batch
    fields = {}
    for k in batch.keys():
        v = batch[k]
        fields[k] = v[:, :width] if k in TOKEN_FIELDS else v
    return TensorDict(fields, batch_size=batch.batch_size, device=batch.device)


_MINUS_ONE = ("token_version", "kv_version", "routed_experts", "old_routed_experts")  # padded with −1 (none)


def cat_batches(batches: list[TensorDict], pad_id: int = 0) -> TensorDict:
    """Concatenate trajectory batches along rows, right-padding token fields ``[B, T]`` to the
    widest ``T`` (tokens with ``pad_id``, masks False, log-probs 0, versions ``NO_VERSION``, routes −1), and the
    per-row vision inputs (``pixel_values [B, P, D]``, ``image_grid_thw [B, I, 3]``) along dim 1 with zeros. One
    batch is returned as is."""
    if len(batches) == 1:
        return batches[0]
    if not batches:
        raise ValueError("cat_batches: no batches")
    T = max(b["tokens"].shape[1] for b in batches)
    # a multimodal batch's per-row vision inputs (hyperrl.multimodal) are padded along dim 1 with zeros
    # (a batch without any image holds them as [B, 0, …]: its trailing shape is taken from the others)
    widest = {k: max(b[k].shape[1] for b in batches) for k in VISION_FIELDS if all(k in b.keys() for b in batches)}
    tails = {k: next((b[k].shape[2:] for b in batches if b[k].shape[1]), batches[0][k].shape[2:]) for k in widest}
    padded = []
    for b in batches:
        extra = T - b["tokens"].shape[1]
        fields = {}
        for k in b.keys():
            v = b[k]
            if k in TOKEN_FIELDS and extra:
                fill = pad_id if k == "tokens" else -1 if k in _MINUS_ONE else 0
                v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, extra), value=fill)
            elif k in widest and v.shape[1] < widest[k]:
                if v.shape[2:] != tails[k]:  # no image in this batch
                    v = v.new_zeros(v.shape[0], 0, *tails[k])
                v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, widest[k] - v.shape[1]))
            fields[k] = v
        padded.append(TensorDict(fields, batch_size=[b.batch_size[0]]))
    return torch.cat(padded, 0)


# a multimodal row's vision inputs, padded per row along dim 1 (pixel_values [B, P, D], image_grid_thw [B, I, 3];
# hyperrl.multimodal builds and reads them)
VISION_FIELDS = frozenset({"pixel_values", "image_grid_thw"})

# keys every trajectory batch has (hyperrl.trajectory) and those the loop can always produce
TRAJECTORY_KEYS = frozenset({"tokens", "attention_mask", "action_mask", "rollout_logprobs", "policy_version",
                             "group_id"})


# reward/reward_components: the task's rewards; old_logprobs: the learner's forward; values: a critic;
# ref_logprobs: a reference model; baseline_reward: a greedy rollout per prompt; token_rewards: the
# rewards' per-token split (RewardSet.token_rewards); teacher_logprobs: algo.distill's teachers; logprobs:
# the update's own (detached) log-probs, which the loss hands a correction (OPSM)
RUN_PRODUCES = frozenset({"reward", "reward_components", "old_logprobs", "values", "ref_logprobs",
                          "baseline_reward", "token_rewards", "teacher_logprobs", "logprobs",
                          "sum_pi_squared", "m2po_keep"})
