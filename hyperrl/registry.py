"""One small registry per kind of variant (advantage estimators, objectives, ...).

A registry maps a name to a callable. ``register`` is a decorator; lookups of unknown names
raise a ``KeyError`` that lists the registered names, so a typo names its fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)

__all__ = ["Registry"]


class Registry(Generic[F]):
    """A named mapping ``name -> callable`` for one kind of transform."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[F], F]:
        """Decorator: ``@REG.register("my_variant")`` adds a function under ``name``."""

        def deco(fn: F) -> F:
            if name in self._items and not overwrite:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
            self._items[name] = fn
            return fn

        return deco

    def get(self, name: str | F) -> F:
        """Return the registered callable (a callable passes through unchanged)."""
        if callable(name):
            return name
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._items)}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
