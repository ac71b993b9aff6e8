"""YAML as a config should read it: YAML 1.2's core schema for numbers and booleans, and no
duplicate keys.

PyYAML implements YAML 1.1, whose implicit types surprise: ``010`` is octal 8, ``1:30`` is the
sexagesimal 90, ``yes`` / ``on`` are booleans, ``1e-6`` (no dot) is a string; and a mapping that
repeats a key silently keeps the last (a config with ``run:`` twice loses the first section). This
loader — PyYAML's ``SafeLoader`` with the 1.2 core resolvers, written here because PyYAML offers
no 1.2 mode and ruamel.yaml would be a second YAML library for one rule — reads ``010`` as 10,
``1:30`` / ``yes`` / ``on`` as strings, ``1e-6`` as a float, and refuses a repeated key naming it
and its line.
"""

from __future__ import annotations

import re

import yaml

from hyperrl.errors import HyperRLError

__all__ = ["load", "DuplicateKeyError"]

_BOOL, _INT, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class DuplicateKeyError(HyperRLError, ValueError):
    """A mapping repeats a key; the message names the key and both lines."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def _int(loader, node) -> int:
    v = loader.construct_scalar(node)
    if v.startswith("0o"):
        return int(v[2:], 8)
    if v.startswith("0x"):
        return int(v[2:], 16)
    return int(v, 10)  # 1.2: "010" is ten


def _float(loader, node) -> float:
    v = loader.construct_scalar(node).lower()
    if v.lstrip("+-") == ".inf":
        return float("-inf") if v.startswith("-") else float("inf")
    if v == ".nan":
        return float("nan")
    return float(v)


def _bool(loader, node) -> bool:
    return loader.construct_scalar(node).lower() == "true"


def _mapping(loader, node, deep=False):
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise DuplicateKeyError(f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); YAML would keep only the last — merge them")
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(_INT, _int)
_Loader.add_constructor(_FLOAT, _float)
_Loader.add_constructor(_BOOL, _bool)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                        lambda loader, node: _mapping(loader, node, deep=True))


def load(text: str):
    """``text`` parsed with the 1.2 core schema, refusing duplicate keys (see the module doc)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
