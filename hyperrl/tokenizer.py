"""A character-level tokenizer built in code (no downloads): the CPU default's tokenizer.

Ids: 0 = ``<pad>``, 1 = ``<bos>``, 2 = ``<eos>``, then one id per character of ``alphabet``.
Unknown characters raise (a tokenizer that silently drops text loses data).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

__all__ = ["CharTokenizer", "DEFAULT_ALPHABET"]

DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=()?.,:;#$%<>[]{}_'\"!\n"


@dataclass(frozen=True)
class CharTokenizer:
    alphabet: str = DEFAULT_ALPHABET
    specials: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError("alphabet: characters must be unique")
        object.__setattr__(self, "_index", {c: i + len(self.specials) for i, c in enumerate(self.alphabet)})

    pad_id = property(lambda self: 0)
    bos_id = property(lambda self: 1)
    eos_id = property(lambda self: 2)

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.alphabet)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        try:
            ids = [self._index[c] for c in text]
        except KeyError as e:
            raise ValueError(f"text: character {e.args[0]!r} is not in the tokenizer's alphabet") from None
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        out = []
        n = len(self.specials)
        for i in ids:
            i = int(i)
            if i < n:
                if not skip_special:
                    out.append(self.specials[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - n])
            else:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return "".join(out)
