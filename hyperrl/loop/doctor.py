"""The mismatch doctor: which known cause makes the trainer's log-probs and the engine's disagree.

Given a recorded batch (the engine's ``rollout_logprobs`` on its action tokens) and the trainer's policy, the
gap is ``|log π_engine − log π_trainer|`` per action token. Each *switch* re-scores the batch with one mechanism
changed to what an engine may have done — the known causes (REFERENCE.md; slime's advice: change one mechanism at
a time) — and the doctor reports how much of the gap each closes, ranked:

* ``sampling`` — temperature, top-k and top-p applied as the engine applied them, the log-prob taken from the
  renormalised (processed) distribution (TRL #6789; vLLM's ``processed_logprobs``);
* ``temperature`` — the log-prob of the untempered logits (an engine reporting them before temperature, TRL #4159);
* ``head_precision`` — the LM head in the other precision (bf16 ↔ fp32; open-instruct #1387);
* ``compute_dtype`` — the model held and run in the other precision (bf16 ↔ fp32: an engine serving bf16 weights);
* ``routes`` — a mixture of experts routed by the engine's recorded routes (R3; Megatron-LM #4168);
* ``version`` — the weights of the version the engine stamped on the tokens (a stale or half-applied publication),
  where those weights are at hand;
* ``padding`` — the prompts left-padded to the batch's longest as a batched engine pads them, the pads attended and
  counted in the positions (an engine batch run without its attention mask; verl #2996);
* ``micro_batch`` — each row alone rather than the batch (composition and padding width; verl #6280 / #2996).

``closes`` = 1 − gap(switch) / gap(trainer) over the action tokens: 1 when the switch reproduces the engine, ≤ 0 when
it makes things worse. :func:`diagnose` → :class:`Diagnosis` (its :meth:`~Diagnosis.verdict` names the cause).

Per layer: the top cause, where it has a per-layer form (``routes``, ``version``), is applied to one decoder layer at
a time — that layer alone routed by the engine's routes, or holding the stamped version's weights — and ``closes`` is
reported per layer (:attr:`Diagnosis.layers`): which layers' routing flips, or which layers a half-applied
publication left stale, make the gap.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

from hyperrl.errors import HyperRLError
from hyperrl.loop.model_calls import first_action
from hyperrl.rollout.hf import filter_logits


class DoctorError(HyperRLError, ValueError):
    """A run the doctor cannot examine (no kept rows at the step, no weights for it); the message says why."""

__all__ = ["SWITCHES", "PER_LAYER", "DoctorContext", "Diagnosis", "diagnose", "trainer_logprobs", "decoder_layers",
           "doctor_run", "DoctorError"]


@dataclass(frozen=True)
class DoctorContext:
    """What the switches read: the run's sampling (``temperature``, ``top_k``, ``top_p``), the trainer's compute and
    head dtypes, the trainer's policy version and ``weights_for(version)`` → that version's state dict or None, the
    tokenizer's ``pad_id``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    dtype: torch.dtype = torch.float32
    head_dtype: torch.dtype | None = None  # None: the model's own
    version: int | None = None
    weights_for: Callable[[int], dict | None] | None = None
    pad_id: int | None = None  # the token a batched engine pads prompts with


def _logits(model, batch: TensorDict, *, dtype: torch.dtype, head_dtype: torch.dtype | None = None,
            replay=None) -> tuple[int, torch.Tensor]:
    """``(a, logits [B, T − a, V])`` fp32 of one plain forward from the batch's first action position ``a``, the
    forward under ``dtype`` autocast (fp32: none) and the LM head recomputed in ``head_dtype`` (None: as it ran)."""
    tokens, act = batch["tokens"], batch["action_mask"]
    a = first_action(act)
    head = model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, inp, out: seen.append(inp[0])) if head_dtype is not None else None
    auto = torch.autocast(tokens.device.type, dtype=dtype) if dtype != torch.float32 else torch.autocast(
        tokens.device.type, enabled=False)
    try:
        with auto, (replay if replay is not None else contextlib.nullcontext()):
            logits = model(input_ids=tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1].long(),
                           logits_to_keep=tokens.shape[1] - a).logits
    finally:
        if hook is not None:
            hook.remove()
    if head_dtype is not None:
        logits = torch.nn.functional.linear(seen[-1].to(head_dtype), head.weight.to(head_dtype),
                                            None if head.bias is None else head.bias.to(head_dtype))
    return a, logits.float()


def _token_lp(a: int, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(z)[token]`` on the window, padded to ``[B, T]``."""
    lp = torch.log_softmax(z, -1).gather(-1, tokens[:, a:, None])[..., 0]
    return torch.nn.functional.pad(lp, (a, 0))


def trainer_logprobs(model, batch: TensorDict, ctx: DoctorContext) -> torch.Tensor:
    """The trainer's view: ``log softmax(logits / T)`` of one forward in its dtype and head precision ``[B, T]``."""
    a, logits = _logits(model, batch, dtype=ctx.dtype, head_dtype=ctx.head_dtype)
    return _token_lp(a, logits / ctx.temperature, batch["tokens"])


def _sampling(model, batch, ctx):
    if not (ctx.top_k or ctx.top_p < 1.0):
        return None
    a, logits = _logits(model, batch, dtype=ctx.dtype, head_dtype=ctx.head_dtype)
    B, W, V = logits.shape
    z = filter_logits(logits.reshape(B * W, V), ctx.temperature, ctx.top_k, ctx.top_p).view(B, W, V)
    return _token_lp(a, z, batch["tokens"])


def _temperature(model, batch, ctx):
    if ctx.temperature == 1.0:
        return None
    a, logits = _logits(model, batch, dtype=ctx.dtype, head_dtype=ctx.head_dtype)
    return _token_lp(a, logits, batch["tokens"])


def _other(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt == torch.bfloat16 else torch.bfloat16


def _head_precision(model, batch, ctx):
    a, logits = _logits(model, batch, dtype=ctx.dtype, head_dtype=_other(ctx.head_dtype or ctx.dtype))
    return _token_lp(a, logits / ctx.temperature, batch["tokens"])


def _compute_dtype(model, batch, ctx):
    other = _other(next(model.parameters()).dtype)  # a copy of the model held in the other dtype, as an engine holds it
    a, logits = _logits(copy.deepcopy(model).to(other), batch, dtype=torch.float32)
    return _token_lp(a, logits / ctx.temperature, batch["tokens"])


def _routes(model, batch, ctx):
    from hyperrl.loop.model_calls import RouteReplay
    from hyperrl.routing import Routing, is_moe

    if not is_moe(model) or "routed_experts" not in batch.keys():
        return None
    tokens = batch["tokens"]
    B, W = tokens.shape[0], tokens.shape[1] - 1
    replay = RouteReplay(Routing(model), batch, batch["routed_experts"], force=True)
    src = torch.nn.functional.pad(torch.arange(B * W).view(B, W), (0, 1), value=-1)
    a, logits = _logits(model, batch, dtype=ctx.dtype, head_dtype=ctx.head_dtype,
                        replay=replay.call(torch.where(batch["attention_mask"].bool(), src, -1), B * W))
    return _token_lp(a, logits / ctx.temperature, tokens)


def _version(model, batch, ctx):
    if ctx.weights_for is None or "token_version" not in batch.keys():
        return None
    v = batch["token_version"][batch["action_mask"].bool()]
    if not v.numel():
        return None
    engine = int(v.min())
    if engine == ctx.version:
        return None
    sd = ctx.weights_for(engine)
    if sd is None:
        return None
    old = copy.deepcopy(model)
    old.load_state_dict(sd)
    return trainer_logprobs(old, batch, ctx)


def _padding(model, batch, ctx):
    """Row ``i`` (prompt length ``p_i`` = its first action position) shifted right by ``P − p_i`` pad tokens
    (``P = max p_i``: a batched engine's left padding) and scored with every position attended and positions
    ``0 … P + T`` — an engine that ran its padded batch without the attention mask. None where every prompt has the
    same length (nothing padded) or the pad token is unknown."""
    tokens, act = batch["tokens"], batch["action_mask"].bool()
    if ctx.pad_id is None or not act.any():
        return None
    B, T = tokens.shape
    has = act.any(-1)
    first = torch.where(has, act.int().argmax(-1), T)  # a row without actions: nothing to score
    P = int(first[has].max())
    shift = torch.where(has, P - first, 0)
    if not bool((shift[has] > 0).any()):
        return None
    S = int(shift.max())
    col = torch.arange(T + S)[None, :] - shift[:, None]  # padded column → the row's own column (< 0: a pad)
    ids = torch.where(col >= 0, tokens.gather(1, col.clamp(0, T - 1)), ctx.pad_id)
    auto = torch.autocast(tokens.device.type, dtype=ctx.dtype) if ctx.dtype != torch.float32 else torch.autocast(
        tokens.device.type, enabled=False)
    with auto:
        logits = model(input_ids=ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1])).logits.float()
    lp = torch.log_softmax(logits / ctx.temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T + S − 1]
    back = (torch.arange(T)[None, :] + shift[:, None] - 1).clamp_min(0)  # the row's column t, predicted at t + s − 1
    return torch.where(torch.arange(T)[None, :] > 0, lp.gather(1, back), 0.0)


def _micro_batch(model, batch, ctx):
    T = batch["tokens"].shape[1]
    rows = []
    for i in range(batch.batch_size[0]):
        att = batch["attention_mask"][i]
        keep = int(att.nonzero().max()) + 1 if att.any() else 1  # the row alone, its own width
        row = TensorDict({k: v[i:i + 1, :keep] if v.dim() >= 2 and v.shape[1] == T else v[i:i + 1]
                          for k, v in batch.items()}, batch_size=[1])
        lp = trainer_logprobs(model, row, ctx) if row["action_mask"][:, 1:].any() else torch.zeros(1, keep)
        rows.append(torch.nn.functional.pad(lp, (0, T - keep)))
    return torch.cat(rows)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers in order: the modules named ``….layers.<i>`` (every transformers decoder family
    names them so; a vision tower's ``blocks`` are not among them)."""
    found = {}
    for name, mod in model.named_modules():
        m = _LAYER.search(name)
        if m is not None and name.endswith(f"layers.{m.group(1)}"):
            found.setdefault(int(m.group(1)), mod)
    return [found[i] for i in sorted(found)]


def _routes_layer(model, batch, ctx, layer: int):
    """The engine's recorded routes replayed in layer ``layer`` only (the others left to the trainer's routers)."""
    only = torch.full_like(batch["routed_experts"], -1)
    only[..., layer, :] = batch["routed_experts"][..., layer, :]
    b = batch.clone(False)  # a shallow copy: the caller's batch keeps its routes
    b["routed_experts"] = only
    return _routes(model, b, ctx)


def _version_layer(model, batch, ctx, layer: int):
    """Layer ``layer`` alone holding the weights of the version the engine stamped."""
    v = batch["token_version"][batch["action_mask"].bool()]
    sd = ctx.weights_for(int(v.min()))
    keep = {k: t for k, t in sd.items() if (m := _LAYER.search(k)) is not None and int(m.group(1)) == layer}
    old = copy.deepcopy(model)
    old.load_state_dict(keep, strict=False)
    return trainer_logprobs(old, batch, ctx)


# the switches with a per-layer form: name → fn(model, batch, ctx, layer) (applied where the whole switch applied)
# (not compute_dtype: rounding one layer differently does not add up to the whole model's rounding — a bf16 engine's
# gap was closed 17 % by layer 0 alone and −14 % by layer 1 — so no layer can be named)
PER_LAYER: dict[str, Callable] = {"routes": _routes_layer, "version": _version_layer}


# name → (what it tries, the function); a function returns None where the switch does not apply to this run
SWITCHES: dict[str, tuple[str, Callable]] = {
    "sampling": ("top-k / top-p applied as the engine sampled, the processed log-prob", _sampling),
    "temperature": ("the log-prob before temperature", _temperature),
    "head_precision": ("the LM head in the other precision (bf16 ↔ fp32)", _head_precision),
    "compute_dtype": ("the model in the other precision (bf16 ↔ fp32)", _compute_dtype),
    "routes": ("the engine's recorded MoE routes replayed", _routes),
    "version": ("the weights of the version the engine stamped", _version),
    "padding": ("the prompts left-padded as a batched engine pads them, the pads attended", _padding),
    "micro_batch": ("each row alone (batch composition, padding width)", _micro_batch),
}


@dataclass
class Diagnosis:
    """``gap``: the trainer's mean |Δ log-prob| over action tokens; ``causes``: ``(switch, what, gap under it,
    closes)`` ranked by how much of the gap each closes; ``skipped``: switches that do not apply here; ``worst``:
    the largest-gap tokens ``(row, position, token, engine, trainer, under the top switch)``; ``versions``: the
    engine's stamped versions and the trainer's; ``layers``: ``(switch, [closes per decoder layer])`` — the top
    cause applied to one layer at a time, where it has a per-layer form (:data:`PER_LAYER`)."""

    gap: float
    causes: list[tuple[str, str, float, float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    worst: list[tuple] = field(default_factory=list)
    versions: tuple = ()
    layers: tuple = ()

    def verdict(self, *, threshold: float = 0.5, rounding: float = 1e-5) -> str:
        """One line: the cause that closes most of the gap (at least ``threshold`` of it), or that none does; a gap
        under ``rounding`` (mean |Δ log-prob|) is float rounding, not a cause."""
        if self.gap <= rounding:
            return (f"no gap beyond float rounding (mean |Δ log-prob| {self.gap:.3g} ≤ {rounding:g}): the trainer "
                    "reproduces the engine's log-probs")
        if self.causes and self.causes[0][3] >= threshold:
            name, what, g, c = self.causes[0]
            return f"{name}: {what} closes {c:.0%} of the gap (mean |Δ log-prob| {self.gap:.3g} → {g:.3g})"
        best = f"; the closest, {self.causes[0][0]}, closes {self.causes[0][3]:.0%}" if self.causes else ""
        return f"none of the known causes closes the gap (mean |Δ log-prob| {self.gap:.3g}){best}"

    def table(self) -> str:
        """The ranked causes as text."""
        lines = [f"trainer vs engine: mean |Δ log-prob| {self.gap:.4g} over the action tokens"
                 + (f"; engine versions {self.versions[0]}, trainer version {self.versions[1]}" if self.versions
                    else "")]
        lines += [f"  {name:15s} " + (f"closes {c:6.1%}" if c >= 0 else "makes it worse") + f"  (gap {g:.4g}) — {what}"
                  for name, what, g, c in self.causes]
        if self.layers:
            name, closes = self.layers
            lines.append(f"  {name} one decoder layer at a time: "
                         + ", ".join(f"layer {i} closes {c:.1%}" for i, c in enumerate(closes)))
        if self.skipped:
            lines.append(f"  not applicable here: {', '.join(self.skipped)}")
        if self.worst:
            lines.append("  worst tokens (row, position, token: engine / trainer / under the top cause):")
            lines += [f"    {r}, {p}, {t}: {e:.4f} / {tr:.4f} / {s:.4f}" for r, p, t, e, tr, s in self.worst]
        return "\n".join(lines)


@torch.no_grad()
def diagnose(model, batch: TensorDict, ctx: DoctorContext, *, switches=None, worst: int = 8,
             max_layers: int = 64) -> Diagnosis:
    """Re-score ``batch`` under each switch (:data:`SWITCHES`, or the names in ``switches``) and rank them by the
    share of the trainer-vs-engine gap they close (module doc); the top cause then one decoder layer at a time where
    it has a per-layer form and the model has at most ``max_layers`` layers (one forward each). ``batch``: tokens,
    attention and action masks, ``rollout_logprobs`` (and ``token_version``, ``routes`` where the switches need
    them)."""
    for k in ("tokens", "attention_mask", "action_mask", "rollout_logprobs"):
        if k not in batch.keys():
            raise KeyError(f"doctor: the batch has no {k!r} — it needs the rollout's rows (tokens, masks, "
                           "rollout_logprobs)")
    act = batch["action_mask"].bool().clone()
    act[:, 0] = False  # position 0 predicts nothing
    engine = batch["rollout_logprobs"].float()
    base = trainer_logprobs(model, batch, ctx)
    d = (engine - base).abs()
    gap = float(d[act].mean()) if act.any() else 0.0
    out = Diagnosis(gap)
    if "token_version" in batch.keys() and act.any():
        out.versions = (sorted(set(batch["token_version"][act].tolist())), ctx.version)
    best_lp = None
    for name in switches or SWITCHES:
        what, fn = SWITCHES[name]
        lp = fn(model, batch, ctx)
        if lp is None:
            out.skipped.append(name)
            continue
        g = float((engine - lp).abs()[act].mean())
        out.causes.append((name, what, g, 1.0 - g / gap if gap > 0 else 0.0))
        if best_lp is None or g < best_lp[0]:
            best_lp = (g, lp)
    out.causes.sort(key=lambda c: -c[3])
    if out.causes and out.causes[0][0] in PER_LAYER and gap > 0 and 0 < len(decoder_layers(model)) <= max_layers:
        name = out.causes[0][0]
        out.layers = (name, [1.0 - float((engine - PER_LAYER[name](model, batch, ctx, i)).abs()[act].mean()) / gap
                             for i in range(len(decoder_layers(model)))])
    if act.any() and best_lp is not None:
        idx = torch.nonzero(act)
        top = torch.topk(d[act], min(worst, len(idx))).indices
        out.worst = [(int(idx[i, 0]), int(idx[i, 1]), int(batch["tokens"][idx[i, 0], idx[i, 1]]),
                      float(engine[idx[i, 0], idx[i, 1]]), float(base[idx[i, 0], idx[i, 1]]),
                      float(best_lp[1][idx[i, 0], idx[i, 1]])) for i in top.tolist()]
    return out


def _checkpoints(run: Path) -> dict[int, Path]:
    """The run's checkpoints by the policy version they hold."""
    from hyperrl.loop.checkpoint import checkpoint_dirs

    out = {}
    for c in checkpoint_dirs(run / "checkpoints", warn=False):
        st = json.loads((c / "state.json").read_text())
        out[int(st.get("version", st.get("step", 0)))] = c
    return out


def doctor_run(run: str | Path, step: int | None = None) -> tuple[Diagnosis, int]:
    """``hyperrl doctor RUN [--step N]``: the recorded batch of step ``N`` (``fingerprints/step_<N>.safetensors``:
    the first ``run.fingerprint_values`` steps; default the last such step the doctor has weights for) scored by the
    policy that trained it — the run's initial weights for step 1, else the checkpoint of version ``N − 1`` (a LoRA
    run's adapters over its base, as its trainer ran them) — under each switch (:func:`diagnose`; the engine's
    stamped version from the checkpoints too). → ``(diagnosis, N)``."""
    from safetensors.torch import load_file

    from hyperrl.config import validate_config
    from hyperrl.device import torch_dtype
    from hyperrl.loop.checkpoint import consolidate
    from hyperrl.models.head import fp32_lm_head
    from hyperrl.models.lora import apply_lora
    from hyperrl.models.policy import build_policy, build_tokenizer

    run = Path(run)
    if not (run / "config.json").is_file():
        raise DoctorError(f"{run}: no config.json — not a run directory (give a run.out_dir)")
    cfg = validate_config(json.loads((run / "config.json").read_text()))
    kept = sorted(int(f.stem.split("_")[1]) for f in (run / "fingerprints").glob("step_*.safetensors"))
    ckpts = _checkpoints(run)
    usable = [k for k in kept if k == 1 or (k - 1) in ckpts]
    if step is None:
        if not usable:
            raise DoctorError(f"{run}: no step has both its rows kept (steps {kept or 'none'}: "
                              "run.fingerprint_values) and the weights that trained it (step 1, or a checkpoint of "
                              f"the version before: {sorted(ckpts) or 'none'})")
        step = usable[-1]
    elif step not in kept:
        raise DoctorError(f"step {step}: its rows were not kept (kept: {kept or 'none'}) — rerun with "
                          f"run.fingerprint_values ≥ {step}")
    elif step not in usable:
        raise DoctorError(f"step {step}: no checkpoint of version {step - 1} (checkpoints of versions "
                          f"{sorted(ckpts) or 'none'}) — rerun with run.ckpt_every dividing {step - 1}")
    tok = build_tokenizer(cfg)
    policy = build_policy(cfg, tok, lora=False)  # as the composition root builds it: the head, then the adapters
    if cfg.model.lm_head_fp32:
        fp32_lm_head(policy)
    lora = cfg.model.lora is not None
    if lora:  # the trainer's view: base + adapters, unmerged (a LoRA checkpoint holds the trainable part only)
        policy = apply_lora(policy, **cfg.model.lora.model_dump())
    init = {k: v.clone() for k, v in policy.state_dict().items()} if lora or step == 1 else None

    def weights_for(v: int):
        if v == 0 and step == 1:
            return init
        if v not in ckpts:
            return None
        sd = consolidate(ckpts[v], "model")
        return {**init, **sd} if lora else sd  # a LoRA checkpoint's adapters over the (unchanged) base

    if step > 1:
        policy.load_state_dict(weights_for(step - 1))
    policy.eval()

    rows = load_file(run / "fingerprints" / f"step_{step}.safetensors")
    batch = TensorDict(rows, batch_size=[rows["tokens"].shape[0]])
    r, m = cfg.rollout, cfg.model
    ctx = DoctorContext(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, dtype=torch_dtype(m.dtype),
                        head_dtype=torch.float32 if m.lm_head_fp32 else None, version=step - 1,
                        weights_for=weights_for, pad_id=tok.pad_token_id)
    return diagnose(policy, batch, ctx), step
