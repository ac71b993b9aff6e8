"""A visual task generated in code (issue 32): coloured cells on a grid, drawn with numpy, questions about them.

An image is a ``grid × grid`` board of ``cell``-pixel squares, each painted one of ``colours`` (letters naming
RGB values, :data:`PALETTE`). A question is about one board:

* ``colour`` — ``"c2?"`` → the letter of cell 2's colour (cells numbered row by row from 0);
* ``count`` — ``"#r?"`` → how many cells are that colour (one digit).

The prompt is the image (one placeholder, expanded to the image's ``t·h·w / merge²`` placeholders by the model's
image processor — the tokens the engine sees, never re-tokenised) followed by the question; the answer is one
character + EOS. A fixed ``held_out_frac`` of the boards (drawn with ``split_seed``, the same for every run seed)
is never trained on: evaluation asks its questions about boards the policy has not seen. Each board's pixels go
through the model's own image processor once (resized by its rules) and are cached.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from hyperrl.data.incode import InCodeTask, held_out_split
from hyperrl.data.parquet import Sample
from hyperrl.multimodal import IMAGE_TEXT, expand_placeholders, image_token_id
from hyperrl.tokenizer import encode_prompt

__all__ = ["PALETTE", "ShapesTask", "draw_board", "IMAGE_PROMPT"]

# colour letter → RGB (well apart in every channel a random patch embedding could read)
PALETTE = {"r": (220, 40, 40), "g": (40, 180, 60), "b": (40, 80, 220), "y": (230, 210, 40), "w": (235, 235, 235),
           "k": (20, 20, 20), "m": (200, 50, 200), "c": (40, 200, 210)}
IMAGE_PROMPT = IMAGE_TEXT  # one image, as the Qwen-VL chat template writes it


def draw_board(board: tuple[str, ...], grid: int, cell: int):
    """The PIL image of ``board`` (``grid²`` colour letters, row by row), ``grid·cell`` pixels square."""
    from PIL import Image

    px = np.zeros((grid * cell, grid * cell, 3), dtype=np.uint8)
    for i, c in enumerate(board):
        r, k = divmod(i, grid)
        px[r * cell:(r + 1) * cell, k * cell:(k + 1) * cell] = PALETTE[c]
    return Image.fromarray(px)


@dataclass
class ShapesTask(InCodeTask):
    """See the module doc. ``image_processor``: the model's (a Qwen2-VL image processor: ``patch_size``,
    ``merge_size``); ``image_token_id``: the tokenizer's ``<|image_pad|>``."""

    tokenizer: object
    image_processor: object
    grid: int = 2
    cell: int = 28
    colours: str = "rgby"
    questions: tuple[str, ...] = ("colour",)
    held_out_frac: float = 0.2
    split_seed: int = 0
    seed: int = 0
    rewards: tuple = ()
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.image_token_id = image_token_id(self.tokenizer, "task shapes")
        self.merge = int(getattr(self.image_processor, "merge_size", 2))
        boards = list(itertools.product(self.colours, repeat=self.grid * self.grid))
        self._train, self._eval = held_out_split(boards, self.held_out_frac, self.split_seed, 13)

    @property
    def response_tokens(self) -> int:
        """One character + EOS."""
        return 2

    def _question(self, board: tuple[str, ...], rng: np.random.Generator) -> Sample:
        kind = self.questions[int(rng.integers(0, len(self.questions)))]
        if kind == "colour":
            i = int(rng.integers(0, len(board)))
            q, a = f"c{i}?", board[i]
        else:
            c = self.colours[int(rng.integers(0, len(self.colours)))]
            q, a = f"#{c}?", str(board.count(c))
        return Sample(IMAGE_PROMPT + q, a, f"shapes:{''.join(board)}:{q}", {"board": "".join(board)})

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        """``k`` questions about training boards for ``step`` — a pure function of (seed, step, attempt)."""
        rng = self._rng(step, attempt)
        return [self._question(self._train[int(rng.integers(0, len(self._train)))], rng) for _ in range(k)]

    def held_out(self, k: int) -> list[Sample]:
        """``k`` questions about held-out boards (each board in turn, a fixed question stream)."""
        rng = np.random.default_rng([self.split_seed, 17])
        return [self._question(self._eval[i % len(self._eval)], rng) for i in range(k)]

    def vision(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """The board's ``(pixel_values [p, D], image_grid_thw [1, 3])`` from the model's image processor (cached)."""
        key = sample.extra["board"]
        if key not in self._cache:
            out = self.image_processor(images=[draw_board(tuple(key), self.grid, self.cell)], return_tensors="pt")
            self._cache[key] = (out["pixel_values"], out["image_grid_thw"])
        return self._cache[key]

    def encode(self, sample: Sample) -> list[int]:
        """The prompt's ids with the image's placeholders expanded to its grid."""
        return expand_placeholders(encode_prompt(self.tokenizer, sample.prompt), self.image_token_id,
                                   self.vision(sample)[1], self.merge)
