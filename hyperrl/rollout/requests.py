"""Resumable generation requests and sampling randomness keyed by (seed, sample_uid, token index).

A :class:`Request` is one sample to generate: its prompt, the response tokens already generated
(``partial``, with their log-probs and the versions that sampled them) and the ids that key it.
An engine's ``generate_requests`` continues every request from ``prompt + partial`` (re-prefill)
and returns a trajectory row per request; when asked to abort (a publication is coming) it stops
at the next decode step and marks unfinished rows ``finish_reason = aborted`` — their partial
tokens are in the row, and :func:`resume_requests` turns them into requests again for the new
weights. The earlier tokens keep their version, the new ones get the new version.

Sampling is inverse-CDF with one uniform per (seed, uid, index) from a counter-based hash
(splitmix64), so a token depends on its logits and its key only — not on the batch, the row's
position in it, or how many steps ran before: an interruption without a weight change is
invisible up to the logits' float rounding (re-prefill vs. cached decode). ``torch.Generator``
streams cannot do that (their draws depend on the order of every earlier draw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from hyperrl.multimodal import model_inputs
from hyperrl.trajectory import FINISH_REASONS

__all__ = ["Request", "keyed_uniform", "keyed_sample", "keyed_seed", "resume_requests", "requests_for",
           "call_key"]

_ABORTED = FINISH_REASONS.index("aborted")
_M1, _M2 = -4658895280553007687, -7723592293110705685  # splitmix64 multipliers as signed int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Request:
    """One sample to generate (see the module doc): its key ``uid``, ``prompt`` ids and ``group_id``, and the
    response generated so far (``partial``, with its log-probs and sampling versions) to continue from."""

    uid: int  # sample_uid: unique over the run; keys the sampling randomness
    prompt: tuple[int, ...]
    group_id: int = 0
    partial: tuple[int, ...] = ()  # response tokens generated so far (under older weights)
    partial_logprobs: tuple[float, ...] = ()
    partial_versions: tuple[int, ...] = ()
    partial_kv_versions: tuple[int, ...] | None = None  # None: each partial token's own version (re-prefilled)
    max_new_tokens: int | None = None  # this response's token limit (partial included); None: the sampling's
    # a mixture of experts: the partial tokens' routes [K, L, k] as the earlier call ran them (−1: none)
    partial_routes: torch.Tensor | None = field(default=None, compare=False)
    # a vision-language prompt's images: (pixel_values [p, D], image_grid_thw [I, 3]) — its placeholders are in
    # ``prompt`` already (hyperrl.multimodal); None: a text prompt
    vision: tuple | None = field(default=None, compare=False)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError(f"Request {self.uid}: empty prompt")
        if not len(self.partial) == len(self.partial_logprobs) == len(self.partial_versions):
            raise ValueError(f"Request {self.uid}: partial, partial_logprobs and partial_versions differ in length")
        if self.partial_kv_versions is not None and len(self.partial_kv_versions) != len(self.partial):
            raise ValueError(f"Request {self.uid}: partial_kv_versions and partial differ in length")
        if self.partial_routes is not None and self.partial_routes.shape[0] != len(self.partial):
            raise ValueError(f"Request {self.uid}: partial_routes has {self.partial_routes.shape[0]} rows for "
                             f"{len(self.partial)} partial tokens")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"Request {self.uid}: max_new_tokens={self.max_new_tokens}; at least 1 (None: the "
                             "sampling's)")

    def budget(self, max_new_tokens: int) -> int:
        """Tokens still to generate under the sampling's ``max_new_tokens`` and this request's own limit."""
        cap = max_new_tokens if self.max_new_tokens is None else min(max_new_tokens, self.max_new_tokens)
        return cap - len(self.partial)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser on Python ints (a per-call key needs no tensor)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def call_key(*parts: int) -> int:
    """A non-negative 63-bit key of ``parts`` — (episode uid, call, choice) of an agent's call, (sample_uid,
    turn) of an environment's turn: what keys that call's sampling, the same in every run and batch."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = _mix64((h ^ (int(p) & _M64)) & _M64)
    return h >> 1


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (Steele et al. 2014) on int64 with wrapping arithmetic."""
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def _key(seed: int, uids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The splitmix64 hash of ``(seed, uid, index)`` per row (int64, wrapping)."""
    h = _mix(torch.full_like(uids, seed, dtype=torch.int64) + _GOLDEN)
    h = _mix(h ^ uids.long())
    return _mix(h ^ index.long())


def keyed_uniform(seed: int, uids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One uniform in ``[0, 1)`` per row, a pure function of ``(seed, uid, index)`` ``[B]`` (float64)."""
    return _srl(_key(seed, uids, index), 11).double() * 2.0 ** -53


def keyed_seed(seed: int, uid: int, index: int) -> int:
    """A non-negative 63-bit seed, a pure function of ``(seed, uid, index)`` — for an engine that
    takes one seed per request (vLLM): a request continued from ``index`` generated tokens gets its
    own stream, the same in every run (deterministic, but not interruption-invisible)."""
    return int(_srl(_key(seed, torch.tensor([uid]), torch.tensor([index])), 1)[0])


def keyed_sample(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of ``[B, V]`` log-probs with uniforms ``u [B]``: the first token whose
    cumulative probability exceeds ``u`` (tokens of probability 0 are never chosen)."""
    cdf = torch.cumsum(logp.double().exp(), -1)
    x = (u.to(cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp(max=logp.shape[-1] - 1)


def requests_for(prompts: list[list[int]], n: int, *, uid_offset: int, group_offset: int = 0) -> list[Request]:
    """``n`` requests per prompt, uids ``uid_offset, uid_offset + 1, …``, group ids from ``group_offset``."""
    return [Request(uid_offset + i * n + j, tuple(p), group_offset + i) for i, p in enumerate(prompts)
            for j in range(n)]


def resume_requests(batch: TensorDict, limits: dict[int, int] | None = None) -> list[Request]:
    """The aborted rows of a ``generate_requests`` batch as requests that continue them: the prompt
    (the tokens before the first action), the generated tokens with their log-probs and versions;
    ``limits``: the requests' own ``max_new_tokens`` by uid (a row does not carry it); a mixture of
    experts' ``routed_experts`` travel with the partial tokens (they keep their routes), a vision-language row's
    images with its prompt.
    Single-turn rows only (a row with observation tokens after its first action is refused)."""
    out = []
    for i in (batch["finish_reason"] == _ABORTED).nonzero()[:, 0].tolist():
        n = int(batch["attention_mask"][i].sum())
        act = batch["action_mask"][i, :n]
        first = int(act.int().argmax()) if bool(act.any()) else n
        if not bool(act[first:].all()):
            raise ValueError(f"resume_requests: row {i} (sample_uid {int(batch['sample_uid'][i])}) has non-action "
                             "tokens after its first action (a multi-turn episode); only single-turn rows resume")
        tok = batch["tokens"][i, :n].tolist()
        out.append(Request(int(batch["sample_uid"][i]), tuple(tok[:first]), int(batch["group_id"][i]),
                           tuple(tok[first:]), tuple(batch["rollout_logprobs"][i, first:n].tolist()),
                           tuple(batch["token_version"][i, first:n].tolist()),
                           tuple(batch["kv_version"][i, first:n].tolist()) if "kv_version" in batch.keys() else None,
                           (limits or {}).get(int(batch["sample_uid"][i])),
                           batch["routed_experts"][i, first:n].clone() if "routed_experts" in batch.keys() else None,
                           _row_vision(batch, i)))
    return out


def _row_vision(batch: TensorDict, i: int) -> tuple | None:
    """Row ``i``'s images as a request carries them (``hyperrl.multimodal``'s per-row layout, padding dropped)."""
    if "image_grid_thw" not in batch.keys():
        return None
    kw = model_inputs(batch[i:i + 1])
    return (kw["pixel_values"].clone(), kw["image_grid_thw"].clone()) if kw else None
