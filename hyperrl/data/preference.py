"""Preference pairs (DPO and kin) as users have them — TRL's and verl's formats — encoded once, token-first.

Formats (column names configurable: ``prompt_key``, ``chosen_key``, ``rejected_key``):

* **explicit prompt** (TRL; verl's ``prompt`` / ``chosen`` / ``rejected`` preference parquet): a
  ``prompt`` string and ``chosen`` / ``rejected`` completion strings — or, conversational, a
  ``prompt`` message list and ``chosen`` / ``rejected`` lists of the completion's messages;
* **implicit prompt** (TRL, e.g. Anthropic HH): no prompt column; ``chosen`` / ``rejected`` hold the
  whole text or conversation, and the prompt is their shared beginning — for conversations the
  messages before the first that differs (the completions must then be the last assistant turns),
  for strings the longest common prefix cut back to a whitespace (TRL's ``extract_prompt``).

Encoding (:meth:`PairDataset.encode`): a string prompt with the tokenizer's special tokens and each
completion as plain text plus EOS (TRL appends it); a conversational pair through the chat template —
the prompt with the generation prompt, each completion as the text the template renders after it
(``template(prompt + completion)`` minus ``template(prompt, add_generation_prompt)``), so the
completion carries the template's own end-of-turn tokens. Both completions follow the **same prompt
ids**. A bad row — a missing column, an empty completion, a pair whose prompt differs between its two
completions, chosen identical to rejected, a text the tokenizer cannot encode — is a
:class:`~hyperrl.data.DataError` naming the file, row and column, raised when the files are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hyperrl.data.parquet import DataError, _read_rows, render_chat

__all__ = ["Pair", "PairDataset", "EncodedPair"]


@dataclass(frozen=True)
class Pair:
    """One preference row after the prompt is resolved (explicit, or the implicit shared beginning): the
    ``prompt``, the ``chosen`` and ``rejected`` completions, its ``source`` and the row's other columns."""

    prompt: str | list  # text or chat messages
    chosen: str | list  # completion text or the completion's messages
    rejected: str | list
    source: str  # "file:row"
    extra: dict


@dataclass(frozen=True)
class EncodedPair:
    """A :class:`Pair` encoded once (see the module doc): the prompt ids and each completion's ids, both
    completions following the same prompt ids."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]  # the completion's ids (after the prompt)
    rejected: tuple[int, ...]


def _messages(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "role" in m and
                                                   isinstance(m.get("content"), str) for m in x)


def _common_prefix_text(a: str, b: str) -> str:
    """TRL's implicit prompt of two strings: the longest common prefix, cut back before a trailing space."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n < min(len(a), len(b)) and n > 0 and a[n - 1] == " ":
        n -= 1
    return a[:n]


def _pair(row: dict, where: str, prompt_key: str, chosen_key: str, rejected_key: str) -> Pair:
    """One row → a :class:`Pair` (see the module doc), or a :class:`DataError` naming the row and column."""
    for key in (chosen_key, rejected_key):
        if key not in row:
            raise DataError(f"{where}: column {key!r} missing (columns: {sorted(row)}); preference data needs "
                            f"{chosen_key!r} and {rejected_key!r} (set data.chosen_key / data.rejected_key)")
    c, r = row[chosen_key], row[rejected_key]
    for key, v in ((chosen_key, c), (rejected_key, r)):
        if not (isinstance(v, str) and v.strip()) and not _messages(v):
            raise DataError(f"{where}: column {key!r} must be a non-empty string or a list of {{role, content}} "
                            f"messages, got {type(v).__name__} {str(v)[:40]!r}")
    if isinstance(c, str) != isinstance(r, str):
        raise DataError(f"{where}: {chosen_key!r} and {rejected_key!r} must both be strings or both messages")
    p = row.get(prompt_key)
    if p is None:  # implicit prompt: the pair's shared beginning
        if isinstance(c, str):
            p = _common_prefix_text(c, r)
            c, r = c[len(p):], r[len(p):]
        else:
            k = 0
            while k < min(len(c), len(r)) and c[k] == r[k]:
                k += 1
            p, c, r = c[:k], c[k:], r[k:]
            if any(m["role"] != "assistant" for m in c + r):
                raise DataError(f"{where}: the prompt differs between {chosen_key!r} and {rejected_key!r} — their "
                                f"conversations part at message {k}, which is not the assistant's last turn; give "
                                f"the shared prompt in a {prompt_key!r} column and the completions alone")
        if not p:
            raise DataError(f"{where}: the prompt differs between {chosen_key!r} and {rejected_key!r} — they share no "
                            f"beginning; give the prompt in a {prompt_key!r} column")
        if not c or not r or (isinstance(c, str) and not c.strip()):
            raise DataError(f"{where}: {chosen_key!r} or {rejected_key!r} has nothing after the shared prompt")
    elif isinstance(p, str):
        if not p.strip():
            raise DataError(f"{where}: column {prompt_key!r} is an empty prompt")
        if not isinstance(c, str):
            raise DataError(f"{where}: a string {prompt_key!r} needs string completions in {chosen_key!r} / "
                            f"{rejected_key!r} (got messages); give the prompt as messages too")
    elif not _messages(p):
        raise DataError(f"{where}: column {prompt_key!r} must be a string or a non-empty list of {{role, content}} "
                        f"messages, got {type(p).__name__}")
    elif isinstance(c, str):  # a conversational prompt with string completions: the assistant's replies
        c, r = [{"role": "assistant", "content": c}], [{"role": "assistant", "content": r}]
    if c == r:
        raise DataError(f"{where}: {chosen_key!r} equals {rejected_key!r}; a pair needs two different completions")
    extra = {k: v for k, v in row.items() if k not in (prompt_key, chosen_key, rejected_key)}
    return Pair(p, c, r, where, extra)


class PairDataset:
    """Preference pairs read from files (parquet / JSONL / JSON) or records and encoded once with
    ``tokenizer`` (see the module doc); indexable and sized like a prompt dataset (for
    :class:`~hyperrl.data.PromptLoader`). ``apply_chat_template``: ``auto`` — messages through the
    template, strings as is; ``always`` — a string pair becomes a user turn and assistant replies;
    ``never`` — messages as plain ``role: content`` lines. ``max_prompt_length`` > 0: a longer prompt
    is an ``error`` (naming the row), ``filter``-ed (counted) or ``truncate``-d to its last tokens."""

    def __init__(self, pairs: list[Pair], tokenizer, *, apply_chat_template: str = "auto",
                 max_prompt_length: int = 0, overlong_prompts: str = "error"):
        if apply_chat_template not in ("auto", "always", "never"):
            raise ValueError(f"data.apply_chat_template={apply_chat_template!r}: choose auto | always | never")
        self.tokenizer, self.chat = tokenizer, apply_chat_template
        self.pairs, self.encoded, self.filtered, self.longest = [], {}, 0, 0
        for pair in pairs:
            enc = self._encode(pair)
            if max_prompt_length and len(enc.prompt) > max_prompt_length:
                if overlong_prompts == "error":
                    raise DataError(f"{pair.source}: prompt of {len(enc.prompt)} tokens > data.max_prompt_length="
                                    f"{max_prompt_length}; raise it, or set data.overlong_prompts to filter or "
                                    "truncate")
                if overlong_prompts == "filter":
                    self.filtered += 1
                    continue
                enc = EncodedPair(enc.prompt[-max_prompt_length:], enc.chosen, enc.rejected)
            self.pairs.append(pair)
            self.encoded[pair.source] = enc
            self.longest = max(self.longest, len(enc.prompt) + max(len(enc.chosen), len(enc.rejected)))
        if not self.pairs:
            raise DataError("no preference pairs (the files have no rows, or every prompt was filtered)")

    @staticmethod
    def from_files(paths, tokenizer, *, prompt_key: str = "prompt", chosen_key: str = "chosen",
                   rejected_key: str = "rejected", **kw) -> PairDataset:
        paths = [paths] if isinstance(paths, str | Path) else list(paths)
        if not paths:
            raise DataError("no data files given")
        pairs = []
        for path in paths:
            for i, row in enumerate(_read_rows(Path(path))):
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{i}: a row must be an object, got {type(row).__name__}")
                pairs.append(_pair(row, f"{path}:{i}", prompt_key, chosen_key, rejected_key))
        return PairDataset(pairs, tokenizer, **kw)

    @staticmethod
    def from_records(records, tokenizer, *, where: str = "records", prompt_key: str = "prompt",
                     chosen_key: str = "chosen", rejected_key: str = "rejected", **kw) -> PairDataset:
        pairs = [_pair(dict(r), f"{where}:{i}", prompt_key, chosen_key, rejected_key) for i, r in enumerate(records)]
        return PairDataset(pairs, tokenizer, **kw)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> Pair:
        return self.pairs[i]

    def _encode(self, pair: Pair) -> EncodedPair:
        try:
            return self._encode_pair(pair)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizer's or its chat template's error, for this row
            raise DataError(f"{pair.source}: the pair cannot be encoded ({type(e).__name__}: {e}); fix the row, or the "
                            "tokenizer (model.tokenizer) and its chat template") from None

    def _encode_pair(self, pair: Pair) -> EncodedPair:
        from hyperrl.tokenizer import encode_prompt, encode_text

        tok, p, c, r = self.tokenizer, pair.prompt, pair.chosen, pair.rejected
        if self.chat == "always" and isinstance(p, str):
            p, c, r = ([{"role": "user", "content": p}], [{"role": "assistant", "content": c}],
                       [{"role": "assistant", "content": r}])
        elif self.chat == "never" and not isinstance(p, str):
            p, c, r = render_chat(p), render_chat(c), render_chat(r)
        if isinstance(p, str):
            eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
            prompt = encode_prompt(tok, p)
            return EncodedPair(tuple(prompt), *(tuple(encode_text(tok, x) + eos) for x in (c, r)))
        head = tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False)
        out = []
        for name, x in (("chosen", c), ("rejected", r)):
            full = tok.apply_chat_template(list(p) + list(x), tokenize=False)
            if not full.startswith(head):
                raise DataError(f"{pair.source}: the chat template does not render the prompt as the beginning of the "
                                f"conversation with its {name} completion; the completion cannot be cut from it")
            out.append(tuple(encode_text(tok, full[len(head):])))
        return EncodedPair(tuple(encode_prompt(tok, p)), *out)

    def encode(self, pair: Pair) -> EncodedPair:
        """The pair's prompt and completion ids (encoded once, at load)."""
        return self.encoded[pair.source]
