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
:func:`check_vision` holds each row's placeholders to its grids (a mismatch fails the forward deep inside the model
otherwise: "Image features and image tokens do not match").
"""

from __future__ import annotations

import torch

__all__ = ["pack_vision", "row_patches", "model_inputs", "check_vision", "VisionError"]


class VisionError(ValueError):
    """A row's vision inputs disagree with its tokens or with themselves; the message names the row."""


def row_patches(grids: torch.Tensor) -> torch.Tensor:
    """Patches per row, ``Σ_i t_i·h_i·w_i``: ``grids [B, I, 3]`` → ``[B]`` (a zero grid counts 0)."""
    return grids.long().prod(-1).sum(-1)


def pack_vision(rows: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """``[(pixel_values [p_b, D] or None, image_grid_thw [n_b, 3] or None), …]`` (one pair per row; None: a row
    without images) → ``{"pixel_values": [B, P, D], "image_grid_thw": [B, I, 3]}``, zero-padded per row. Each
    row's patches must number ``Σ t·h·w`` of its grids (error names the row)."""
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


def check_vision(batch, *, image_token_id: int, merge: int = 2) -> None:
    """Each row's image placeholder tokens (``tokens == image_token_id`` inside ``attention_mask``) number
    ``Σ t·h·w / merge²`` of its grids, and its patches fit ``pixel_values``; a :class:`VisionError` names the first
    row that disagrees."""
    for k in ("pixel_values", "image_grid_thw"):
        if k not in batch.keys():
            raise VisionError(f"{k}: missing (a multimodal batch carries pixel_values and image_grid_thw per row)")
    grids = batch["image_grid_thw"]
    if grids.dim() != 3 or grids.shape[-1] != 3:
        raise VisionError(f"image_grid_thw: shape {tuple(grids.shape)}, expected [B, I, 3]")
    counts = row_patches(grids)
    merged = grids.long().prod(-1)
    if bool((merged % (merge * merge)).any()):
        b = int((merged % (merge * merge)).any(-1).nonzero()[0])
        raise VisionError(f"row {b}: image_grid_thw {grids[b].tolist()} has a grid whose t·h·w is not a multiple "
                          f"of merge² = {merge * merge}")
    placeholders = ((batch["tokens"] == image_token_id) & batch["attention_mask"].bool()).sum(-1)
    want = counts // (merge * merge)
    bad = (placeholders != want.to(placeholders.device)).nonzero()
    if len(bad):
        b = int(bad[0])
        raise VisionError(f"row {b}: {int(placeholders[b])} image placeholder tokens (id {image_token_id}) but its "
                          f"image_grid_thw {grids[b][merged[b] > 0].tolist()} takes {int(want[b])}")
    if counts.numel() and int(counts.max()) > batch["pixel_values"].shape[1]:
        b = int((counts > batch["pixel_values"].shape[1]).nonzero()[0])
        raise VisionError(f"row {b}: its grids need {int(counts[b])} patches, pixel_values holds "
                          f"{batch['pixel_values'].shape[1]} a row")
