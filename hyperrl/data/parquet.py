"""Prompt datasets — parquet, JSONL / JSON, or records / an HF ``datasets.Dataset`` from Python —
with verl's column conventions, and a resumable, deterministic loader.

Columns (names configurable): ``prompt`` — a string or a chat message list
(``[{"role": ..., "content": ...}]``); the answer comes from ``reward_model.ground_truth`` when
present, else ``extra_info`` (a scalar, or a mapping with ``ground_truth`` / ``answer`` /
``solution``), else an ``answer`` column. Bad rows (missing column, wrong type, empty prompt) raise
a :class:`DataError` naming the file, row and column — or, with ``bad_rows="skip"``, are skipped
and counted (``dataset.skipped``); nothing is dropped silently.

:class:`PromptLoader` shuffles deterministically per epoch (``seed + epoch``) and keeps a cursor
(:class:`CursorState`: epoch, index, samples and tokens consumed) that goes into checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from hyperrl.errors import HyperRLError

__all__ = ["Sample", "PromptDataset", "PromptLoader", "CursorState", "DataError", "render_chat"]


class DataError(HyperRLError, ValueError):
    """A bad file or row; the message names file, row and column."""


@dataclass(frozen=True)
class Sample:
    """One prompt row: the ``prompt``, its ``answer`` (``None`` when none is required and the row has none),
    where it came from (``"file:row"``) and the row's other columns (``extra``, e.g. ``data_source``)."""

    prompt: str | list  # text or chat messages
    answer: Any
    source: str  # "file:row"
    extra: dict


def data_source(sample) -> str | None:
    """A prompt's ``data_source`` (verl's column, kept in ``extra``); None for samples without one (tasks
    generated in code)."""
    return (getattr(sample, "extra", None) or {}).get("data_source")


def render_chat(messages: list) -> str:
    """Plain template for chat prompts: ``role: content`` lines (tokenizers without a chat template)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def _answer(row: dict, gt_key: str, extra_key: str, answer_key: str):
    rm = row.get(gt_key.split(".")[0])
    if isinstance(rm, dict) and rm.get(gt_key.split(".", 1)[1]) is not None:
        return rm[gt_key.split(".", 1)[1]]
    ex = row.get(extra_key)
    if isinstance(ex, dict):
        for k in ("ground_truth", "answer", "solution"):
            if ex.get(k) is not None:
                return ex[k]
    elif ex is not None:
        return ex
    return row.get(answer_key)


class PromptDataset:
    """Loaded prompt rows (:class:`Sample`) and how many were skipped (``overlong_prompts: filter``); indexable,
    sized."""

    def __init__(self, samples: list[Sample], skipped: int = 0):
        self.samples, self.skipped = samples, skipped

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    @staticmethod
    def from_parquet(paths, **kw) -> PromptDataset:
        """Rows of parquet files (see :meth:`from_files`)."""
        return PromptDataset.from_files(paths, **kw)

    @staticmethod
    def from_files(paths, *, prompt_key: str = "prompt", ground_truth_key: str = "reward_model.ground_truth",
                   extra_key: str = "extra_info", answer_key: str = "answer", bad_rows: str = "error",
                   require_answer: bool = True) -> PromptDataset:
        """Rows of ``.parquet``, ``.jsonl`` and ``.json`` (a list of objects) files, in order."""
        if bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows={bad_rows!r}; choose 'error' or 'skip'")
        paths = [paths] if isinstance(paths, str | Path) else list(paths)
        if not paths:
            raise DataError("no data files given")
        samples, skipped = [], 0
        for path in paths:
            path = Path(path)
            rows = _read_rows(path)
            if rows and prompt_key not in rows[0]:
                raise DataError(f"{path}: column {prompt_key!r} missing (columns: {sorted(rows[0])}); set "
                                "data.prompt_key to the prompt's column")
            got, bad = _samples(rows, str(path), prompt_key, ground_truth_key, extra_key, answer_key, require_answer,
                                bad_rows)
            samples += got
            skipped += bad
        return PromptDataset(samples, skipped)

    @staticmethod
    def from_records(records, *, where: str = "records", prompt_key: str = "prompt",
                     ground_truth_key: str = "reward_model.ground_truth", extra_key: str = "extra_info",
                     answer_key: str = "answer", require_answer: bool = True) -> PromptDataset:
        """Rows from Python: a list of dicts or an HF ``datasets.Dataset`` (iterates as dicts)."""
        rows = [dict(r) for r in records]
        got, _ = _samples(rows, where, prompt_key, ground_truth_key, extra_key, answer_key, require_answer, "error")
        return PromptDataset(got)


def _read_rows(path: Path) -> list[dict]:
    import json

    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file (a data file is parquet, jsonl or json)")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow as pa

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]})") from None
    if suffix in (".jsonl", ".json"):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start}) — is it a {suffix[1:]} file?") from None
        if suffix == ".json":
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
            if not isinstance(rows, list):
                raise DataError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise DataError(f"{path}: item {bad} is a {type(rows[bad]).__name__}, expected a JSON object")
            return rows
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as e:
                    raise DataError(f"{path}:{i + 1}: not JSON ({getattr(e, 'msg', 'nested too deep')})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{i + 1}: a JSON object per line, got {type(row).__name__}")
                rows.append(row)
        return rows
    raise DataError(f"{path}: unsupported data file type {suffix!r} (parquet, jsonl, json)")


def _samples(rows, where, prompt_key, gt_key, extra_key, answer_key, require_answer, bad_rows):
    out, skipped = [], 0
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise DataError(f"{where}:{i}: a row must be an object, got {type(row).__name__}")
            out.append(_sample(row, f"{where}:{i}", prompt_key, gt_key, extra_key, answer_key, require_answer))
        except DataError:
            if bad_rows == "error":
                raise
            skipped += 1
    return out, skipped


def _sample(row, where, prompt_key, gt_key, extra_key, answer_key, require_answer) -> Sample:
    p = row.get(prompt_key)
    if isinstance(p, str):
        if not p.strip():
            raise DataError(f"{where}: column {prompt_key!r} is an empty prompt")
    elif isinstance(p, list):
        if not p or not all(isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in p):
            raise DataError(f"{where}: column {prompt_key!r} must be a non-empty list of {{role, content}} messages")
    else:
        raise DataError(f"{where}: column {prompt_key!r} has type {type(p).__name__}; expected str or message list")
    ans = _answer(row, gt_key, extra_key, answer_key)
    if require_answer and ans is None:
        raise DataError(f"{where}: no answer in {gt_key!r}, {extra_key!r} or {answer_key!r}")
    return Sample(p, ans, where, {k: v for k, v in row.items() if k != prompt_key})


@dataclass(frozen=True)
class CursorState:
    """A :class:`PromptLoader`'s resumable cursor (saved in checkpoints): the epoch, the position in its
    permutation, and the samples and tokens consumed so far."""

    epoch: int = 0
    index: int = 0  # position within the epoch's permutation
    samples: int = 0  # consumed in all
    tokens: int = 0  # consumed in all (as reported by the caller)


class PromptLoader:
    """Deterministic shuffled batches with a resumable cursor (``state`` / ``PromptLoader(…, state=)``)."""

    def __init__(self, dataset: PromptDataset, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 state: CursorState | None = None):
        if len(dataset) == 0:
            raise DataError("dataset is empty (every row was skipped or the files have no rows)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be ≥ 1")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.state = state or CursorState()

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        return np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)

    def next_batch(self, k: int | None = None) -> list[Sample]:
        """The next ``k`` (default ``batch_size``) samples, crossing epoch boundaries (each epoch
        reshuffled)."""
        k = self.batch_size if k is None else k
        if k < 1:
            raise ValueError(f"k={k}: must be ≥ 1")
        out, st = [], self.state
        while len(out) < k:
            order = self._order(st.epoch)
            take = min(k - len(out), len(order) - st.index)
            out += [self.dataset[int(i)] for i in order[st.index: st.index + take]]
            st = replace(st, index=st.index + take, samples=st.samples + take)
            if st.index == len(order):
                st = replace(st, epoch=st.epoch + 1, index=0)
        self.state = st
        return out

    def add_tokens(self, n: int) -> None:
        self.state = replace(self.state, tokens=self.state.tokens + int(n))
