"""Vision inputs carried per row beside the tokens (issue 32, item 1 — the data layout; a foundation).

A Qwen-VL image enters the model as its patches, ``pixel_values [p, D]`` (``D = 3 · t_patch · patch²``: 1176 for
Qwen2.5-VL), with its grid ``[t, h, w]`` (``image_grid_thw``; ``p = t·h·w``), and takes ``p / merge²`` placeholder
tokens in ``tokens`` — exactly as the engine saw them, never re-tokenised. A model call takes the patches of all its
images concatenated, grids in the same order. Rows have different image counts and sizes, so a batch stores them
**padded per row**, like the tokens along ``T``:

* ``pixel_values [B, P, D]`` — row ``b``'s patches first (its images in order), zeros after (``P`` = the most
  patches of any row);
* ``image_grid_thw [B, I, 3]`` — row ``b``'s grids first, zero rows after (``I`` = the most images of any row; a
  zero grid is no image).

Every ``[B, …]`` operation — row selection, data-parallel sharding, micro-batching — carries them unchanged;
:func:`~hyperrl.trajectory.cat_batches` pads them along dim 1 (``trajectory.VISION_FIELDS``). :func:`pack_vision` builds
the two keys from per-row tensors, :func:`model_inputs` gives a model call its concatenated inputs back, and
:func:`hyperrl.trajectory.check_vision` (called by ``validate(..., image_token_id=…)``) holds each row's placeholders
to its grids (a mismatch fails the forward deep inside the model otherwise: "Image features and image tokens do not
match").
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from hyperrl.errors import HyperRLError

__all__ = ["pack_vision", "row_patches", "model_inputs", "VisionError", "VisionSpec", "vision_spec",
           "expand_placeholders", "rope_positions", "forward_inputs", "suppress_outputs", "output_mask",
           "vision_identity", "VISION_SPECIAL_TOKENS", "IMAGE_TEXT", "image_token_id"]

# the Qwen-VL family's vision special tokens, in the order a tokenizer built for it adds them
VISION_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"  # one image, as the Qwen-VL chat template writes it


def image_token_id(tokenizer, who: str) -> int:
    """The tokenizer's ``<|image_pad|>`` id; a tokenizer without it is an error naming ``who`` needs it."""
    i = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    if i is None or i == tokenizer.unk_token_id:
        raise ValueError(f"{who}: the tokenizer has no <|image_pad|> token; use a vision-language model's tokenizer "
                         "(model.vision builds the character tokenizer with the vision tokens)")
    return i


class VisionError(HyperRLError, ValueError):
    """A row's vision inputs disagree with its tokens or with themselves; the message names the row."""


def row_patches(grids: torch.Tensor) -> torch.Tensor:
    """Patches per row, ``Σ_i t_i·h_i·w_i``: ``grids [B, I, 3]`` → ``[B]`` (a zero grid counts 0)."""
    return grids.long().prod(-1).sum(-1)


def pack_vision(rows: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """``[(pixel_values [p_b, D] or None, image_grid_thw [n_b, 3] or None), …]`` (one pair per row; None or
    ``(None, None)``: a row without images) → ``{"pixel_values": [B, P, D], "image_grid_thw": [B, I, 3]}``,
    zero-padded per row. Each row's patches must number ``Σ t·h·w`` of its grids (error names the row)."""
    rows = [(None, None) if r is None else r for r in rows]
    dims = {int(pv.shape[1]) for pv, _ in rows if pv is not None}
    if len(dims) > 1:
        raise VisionError(f"pixel_values: rows have patch widths {sorted(dims)}; one model, one width")
    D = dims.pop() if dims else 1
    P = max((int(pv.shape[0]) for pv, _ in rows if pv is not None), default=0)
    I_ = max((int(g.shape[0]) for _, g in rows if g is not None), default=0)
    dtype = next((pv.dtype for pv, _ in rows if pv is not None), torch.float32)
    pixels = torch.zeros(len(rows), P, D, dtype=dtype)
    grids = torch.zeros(len(rows), I_, 3, dtype=torch.long)
    for b, (pv, g) in enumerate(rows):
        p = 0 if pv is None else int(pv.shape[0])
        want = 0 if g is None else int(g.long().prod(-1).sum())
        if p != want:
            grid = [] if g is None else g.tolist()
            raise VisionError(f"row {b}: {p} patches in pixel_values, its image_grid_thw {grid} needs {want}")
        if p:
            pixels[b, :p] = pv
        if g is not None and len(g):
            grids[b, :len(g)] = g
    return {"pixel_values": pixels, "image_grid_thw": grids}


def model_inputs(batch) -> dict[str, torch.Tensor]:
    """A model call's vision inputs for the rows of ``batch`` (a TensorDict or mapping with both keys), in row order:
    ``pixel_values [Σ_b p_b, D]`` (each row's patches, padding dropped) and ``image_grid_thw [Σ_b n_b, 3]`` (its
    non-zero grids); ``{}`` when no row has an image."""
    grids, pixels = batch["image_grid_thw"], batch["pixel_values"]
    counts = row_patches(grids)
    if not int(counts.sum()):
        return {}
    keep = torch.arange(pixels.shape[1], device=pixels.device)[None, :] < counts[:, None].to(pixels.device)
    real = grids.long().prod(-1) > 0
    return {"pixel_values": pixels[keep], "image_grid_thw": grids[real]}


@dataclass(frozen=True)
class VisionSpec:
    """What the loop needs of a vision-language model: its image placeholder id, the 2×2 (``merge``) patch merge
    (an image of grid ``[t, h, w]`` takes ``t·h·w / merge²`` placeholders), and ``input_only`` — the vision
    special ids the model reads but a policy must never emit (placeholders, vision start/end: a sampled
    placeholder has no image behind it, and the next forward fails)."""

    image_token_id: int
    merge: int
    input_only: tuple[int, ...]


def vision_spec(model) -> VisionSpec | None:
    """The :class:`VisionSpec` of a Qwen-VL-family model (``config.vision_config``; read duck-typed through
    wrappers: PEFT, FSDP), None for a text-only model."""
    cfg = getattr(model, "config", None)
    vc = getattr(cfg, "vision_config", None)
    if vc is None or getattr(cfg, "image_token_id", None) is None:
        return None
    ids = [getattr(cfg, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                           "vision_end_token_id")]
    return VisionSpec(int(cfg.image_token_id), int(getattr(vc, "spatial_merge_size", 2)),
                      tuple(sorted({int(i) for i in ids if i is not None})))


def expand_placeholders(ids: list[int], image_token_id: int, grids, merge: int = 2) -> list[int]:
    """``ids`` with its ``k``-th image placeholder (one token per image, as a chat template or a prompt string
    writes it) repeated ``t·h·w / merge²`` times for grid ``grids[k]`` — the Qwen-VL processors' rule. The
    placeholders must number the images (the error says both counts)."""
    grids = [] if grids is None else [tuple(int(x) for x in g) for g in grids]
    at = [i for i, t in enumerate(ids) if int(t) == image_token_id]
    if len(at) != len(grids):
        raise VisionError(f"{len(at)} image placeholders (id {image_token_id}) for {len(grids)} images; write one "
                          "placeholder per image")
    out, k = [], 0
    for t in ids:
        if int(t) == image_token_id:
            t_, h, w = grids[k]
            if (t_ * h * w) % (merge * merge):
                raise VisionError(f"image {k}: grid {[t_, h, w]} is not a multiple of merge² = {merge * merge}")
            out += [image_token_id] * (t_ * h * w // (merge * merge))
            k += 1
        else:
            out.append(int(t))
    return out


_ROPE_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its rope-index module, found once


def _rope_owner(model):
    """The module that computes a VLM's rope index (``get_rope_index``; Qwen2/2.5/3-VL's inner model), found once per
    model (every forward asks)."""
    owner = _ROPE_OWNERS.get(model)
    if owner is not None:
        return owner
    for m in model.modules():
        if callable(getattr(type(m), "get_rope_index", None)):
            _ROPE_OWNERS[model] = m
            return m
    raise VisionError(f"{type(model).__name__}: no get_rope_index (not a Qwen-VL family model); its positions "
                      "cannot be computed here")


def rope_positions(model, ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None,
                   image_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The multimodal rotary positions (Qwen's M-RoPE) of ``ids [B, T]``: ``(positions [3, B, T], delta [B])`` by
    the model's own ``get_rope_index`` — text tokens count up on all three axes, an image's placeholders take
    (temporal, height, width) positions of its grid, the text after it resumes at the largest position + 1;
    padding (``attention_mask`` 0, either side) gets 0. ``image_grid_thw [N, 3]``: the grids of the batch's images
    in row order (:func:`model_inputs`). A token ``j`` positions past the row's last real token sits at
    ``(last index + j) + delta`` on every axis — how decoding continues. The one place positions are computed:
    the rollout engine's prefill and the trainer's forwards both call it (through :func:`forward_inputs`)."""
    types = (ids == image_token_id).int()
    pos, delta = _rope_owner(model).get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw,
                                                   attention_mask=attention_mask.long())
    return pos, delta.reshape(-1)


def forward_inputs(model, spec: VisionSpec, ids: torch.Tensor, attention_mask: torch.Tensor, vision) -> dict:
    """A vision-language model call's extra inputs for ``ids [B, T]``: the rows' images (``vision``: a mapping with
    ``pixel_values [B, P, D]`` and ``image_grid_thw [B, I, 3]`` for the same rows, or None) concatenated in row
    order, and ``position_ids [3, B, T]`` from :func:`rope_positions`."""
    kw = model_inputs(vision) if vision is not None else {}
    pos, _ = rope_positions(model, ids, attention_mask, kw.get("image_grid_thw"), spec.image_token_id)
    if "pixel_values" in kw:
        kw["pixel_values"] = kw["pixel_values"].to(ids.device)
        kw["image_grid_thw"] = kw["image_grid_thw"].to(ids.device)
    return {**kw, "position_ids": pos}


def _mask_outputs(ids: torch.Tensor, value: float, module, args, output):
    return output.index_fill(-1, ids.to(output.device), value)


def output_mask(hook) -> tuple[torch.Tensor, float] | None:
    """``(ids, value)`` when ``hook`` (a module's forward hook) is one :func:`suppress_outputs` registered, else None
    — what a forward that skips the head (the fused head) applies itself."""
    if isinstance(hook, functools.partial) and hook.func is _mask_outputs:
        return hook.args[0], float(hook.args[1])
    return None


def suppress_outputs(model, ids: tuple[int, ...], value: float = -1e4):
    """Give the ids in ``ids`` the logit ``value`` at the model's output head (a forward hook on its output
    embeddings): the policy's distribution is over the other tokens, for the rollout engine and the trainer alike
    (both call the same module, so their log-probs still agree to rounding). ``-1e4`` rather than ``-inf``: its
    probability is exactly 0 in fp32 (and after a temperature) while ``0 · log 0`` terms (entropy) stay finite.
    Returns the hook handle; a model copied after (``copy.deepcopy``) keeps it."""
    head = model.get_output_embeddings()
    if head is None:
        raise VisionError(f"{type(model).__name__}: no output embeddings to suppress tokens at")
    return head.register_forward_hook(functools.partial(_mask_outputs, torch.tensor(sorted(ids)), value))


def vision_identity(batch) -> torch.Tensor:
    """``[B]`` ints, equal for two rows exactly when their vision inputs are bitwise equal (their grids and their
    padded patches) — what tells two prompts with the same placeholder tokens but different images apart. All
    zero when the batch has no vision inputs."""
    if "image_grid_thw" not in batch.keys():
        return torch.zeros(batch["tokens"].shape[0], dtype=torch.long)
    px = batch["pixel_values"]
    bits = px.contiguous().view(px.shape[0], -1)
    bits = bits.view(torch.int32) if bits.dtype == torch.float32 else bits.view(torch.int16).long()
    key = torch.cat([batch["image_grid_thw"].reshape(px.shape[0], -1).long(), bits.long()], 1)
    if not key.shape[1]:  # no row has an image
        return torch.zeros(px.shape[0], dtype=torch.long)
    return torch.unique(key, dim=0, return_inverse=True)[1]
