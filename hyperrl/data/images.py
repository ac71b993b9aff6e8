"""Multimodal prompts as users have them (issue 32, item 3): a chat prompt with image placeholders and its
images, read from parquet / JSONL rows in verl's or TRL's format, every image decoded once at load.

* **verl** (its geo3k preprocessing): ``prompt`` — chat messages whose string content holds ``<image>``
  placeholders; ``images`` — a list of ``{"bytes": …, "path": …}`` (or bare bytes / path strings); the answer in
  ``reward_model.ground_truth`` / ``extra_info`` like any verl row (:mod:`hyperrl.data.parquet`).
* **TRL** (VLM GRPO): a conversational ``prompt`` whose content is a list of parts — ``{"type": "image"}`` is a
  placeholder, ``{"type": "text", "text": …}`` text — or a string with ``<image>``; the images in ``images`` (a
  list) or ``image`` (one), each as HF ``datasets`` stores an ``Image`` feature in parquet
  (``{"bytes": …, "path": …}``), bytes or a path.

A path is read relative to the data file's directory and must stay inside it (or the task's ``image_root``):
``../``, absolute paths and symlinks that lead out are refused before anything says whether the file exists.
Errors name the file, the row and the column: a path that leads out, a missing file, bytes no image decoder reads,
a decompression bomb (past Pillow's ``MAX_IMAGE_PIXELS``, ≈ 89 M pixels: refused), a prompt whose placeholders
do not match the images it comes with. Images are decoded with Pillow (the library transformers' image processors
read) and converted to RGB; an image larger than the processor's ``max_pixels`` — its size read from its header
first — is **downscaled** at load to fit (aspect kept; Pillow's draft / reduce decode a JPEG at the smaller size):
the processor would shrink it to at most ``max_pixels`` anyway, and a full-size decoded image is never kept (a
parquet of 9,000 × 8,900 blank PNGs once took a run to 5 GB). The rest of the resizing is the processor's.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperrl.data.parquet import DataError, _answer, _read_rows

__all__ = ["IMAGE_PLACEHOLDER", "VisionSample", "count_placeholders", "decode_image", "placeholders_as_text",
           "vision_samples"]

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class VisionSample:
    """One multimodal prompt: ``prompt`` (a string or chat messages, placeholders as written), ``images``
    (decoded RGB ``PIL.Image`` objects, in placeholder order), ``answer``, ``source`` (``"file:row"``) and
    ``extra`` (the row's other columns: ``data_source``, ``extra_info`` …)."""

    prompt: str | list
    images: tuple
    answer: Any
    source: str
    extra: dict = field(default_factory=dict)


def count_placeholders(prompt) -> int:
    """Image placeholders in ``prompt``: ``<image>`` in a string or a message's string content, and TRL's
    ``{"type": "image"}`` content parts."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    n = 0
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    n += 1
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    n += part["text"].count(IMAGE_PLACEHOLDER)
    return n


def _inside(path: Path, roots: list[Path], where: str, raw: str) -> Path:
    """``path`` resolved (symlinks followed), refused unless it lies under one of ``roots`` — before anything
    says whether it exists."""
    real = path.resolve()
    if not any(real.is_relative_to(r.resolve()) for r in roots):
        raise DataError(f"{where}: image path {raw!r} leads outside the data file's directory"
                        + (" and image_root" if len(roots) > 1 else "") + " — image paths stay inside it (set the "
                        "task's image_root to allow another directory)")
    return real


def _fit(im, max_pixels: int | None, where: str):
    """Decode ``im`` (opened: only its header read) as RGB, shrunk to at most ``max_pixels`` (aspect kept) when
    larger — by Pillow's draft / reduce where the format allows, so a huge image is never kept whole."""
    w, h = im.size
    if max_pixels and w * h > max_pixels:
        scale = (max_pixels / (w * h)) ** 0.5
        im.thumbnail((max(1, int(w * scale)), max(1, int(h * scale))))
    return im.convert("RGB")


def decode_image(value, where: str, base_dir: Path | None = None, *, max_pixels: int | None = None,
                 root: Path | None = None):
    """An RGB ``PIL.Image`` from ``{"bytes", "path"}`` (bytes win when both are set), bytes, a path string or a
    ``PIL.Image``, shrunk to ``max_pixels`` when larger (its header read first: see the module doc); a
    :class:`DataError` naming ``where`` for a path outside ``base_dir`` (and ``root``), a missing file, undecodable
    bytes or a decompression bomb (past Pillow's ``MAX_IMAGE_PIXELS``)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return _fit(value, max_pixels, where)
    data, path = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (None, None)
    if isinstance(value, bytes | bytearray):
        data = value
    elif isinstance(value, str):
        path = value
    if data is None and not path:
        raise DataError(f"{where}: neither image bytes nor a path ({type(value).__name__})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if data is not None:
                with Image.open(io.BytesIO(data)) as im:
                    return _fit(im, max_pixels, where)
            p = Path(path)
            if base_dir is not None:
                p = _inside(base_dir / p, [base_dir] + ([root] if root is not None else []), where, path)
            if not p.is_file():
                raise DataError(f"{where}: no such image file {path!r}")
            with Image.open(p) as im:
                return _fit(im, max_pixels, where)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(f"{where}: refused as a decompression bomb ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: not a readable image ({e})") from None


def _row_images(row: dict, where: str, image_key: str | None, base_dir: Path | None, **limits) -> list:
    keys = [image_key] if image_key else [k for k in ("images", "image") if k in row]
    if not keys or keys[0] not in row:  # a text-only row (its placeholders, if any, are counted against none)
        return []
    key, value = keys[0], row[keys[0]]
    values = [] if value is None else (list(value) if isinstance(value, list | tuple) else [value])
    return [decode_image(v, f"{where}: column {key!r}[{i}]", base_dir, **limits) for i, v in enumerate(values)]


def vision_samples(path: str | Path, *, prompt_key: str = "prompt", image_key: str | None = None,
                   gt_key: str = "reward_model.ground_truth", extra_key: str = "extra_info", answer_key: str = "answer",
                   require_answer: bool = True, max_pixels: int | None = None,
                   image_root: str | Path | None = None) -> list[VisionSample]:
    """Every row of ``path`` (parquet, JSONL or JSON) as a :class:`VisionSample` — its images decoded once
    (``image_key``: the column; default ``images``, else ``image``; shrunk to ``max_pixels``; paths inside the
    file's directory or ``image_root``), its placeholders counted against them."""
    path = Path(path)
    out = []
    for i, row in enumerate(_read_rows(path)):
        where = f"{path}:{i}"
        prompt = row.get(prompt_key)
        if not isinstance(prompt, str | list) or not prompt:
            raise DataError(f"{where}: column {prompt_key!r} must be a non-empty string or message list")
        images = _row_images(row, where, image_key, path.parent, max_pixels=max_pixels,
                             root=Path(image_root) if image_root is not None else None)
        n = count_placeholders(prompt)
        if n != len(images):
            raise DataError(f"{where}: column {prompt_key!r} has {n} image placeholder(s) but the row has "
                            f"{len(images)} image(s); each <image> (or {{\"type\": \"image\"}} part) takes one image")
        ans = _answer(row, gt_key, extra_key, answer_key)
        if require_answer and ans is None:
            raise DataError(f"{where}: no answer in {gt_key!r}, {extra_key!r} or {answer_key!r}")
        extra = {k: v for k, v in row.items() if k not in (prompt_key, image_key, "images", "image")}
        out.append(VisionSample(prompt, tuple(images), ans, where, extra))
    return out


def placeholders_as_text(prompt, image_text: str):
    """``prompt`` with every image placeholder — ``<image>`` in a string or a message's string content, TRL's
    ``{"type": "image"}`` part — written as ``image_text`` (the model's vision tokens, e.g. Qwen-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, what its chat template writes for an image part) and every
    message's content a string: the form the tokenizer (and its chat template) encodes."""
    if isinstance(prompt, str):
        return prompt.replace(IMAGE_PLACEHOLDER, image_text)
    out = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(image_text if part.get("type") == "image" else str(part.get("text", ""))
                              for part in content if isinstance(part, dict))
        out.append({**m, "content": str(content or "").replace(IMAGE_PLACEHOLDER, image_text)})
    return out
