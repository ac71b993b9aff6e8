"""One exception base: every error class hyperrl defines is a :class:`hyperrl.errors.HyperRLError` (and still the
builtin it refines), read from the source of every module — so a new error class without it fails here."""

import ast
from pathlib import Path

import pytest

from hyperrl.errors import HyperRLError

PKG = Path(__file__).parents[1] / "hyperrl"
BUILTIN = {"Exception", "ValueError", "RuntimeError", "AssertionError", "KeyError", "TypeError", "OSError",
           "TimeoutError"}


def _classes() -> dict[str, tuple[str, list[str]]]:
    """Class name → (module path, base names) of every top-level class in the package."""
    out = {}
    for p in PKG.rglob("*.py"):
        for n in ast.parse(p.read_text()).body:
            if isinstance(n, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "?"
                         for b in n.bases]
                out[n.name] = (str(p.relative_to(PKG.parent)), bases)
    return out


def test_every_public_error_class_derives_from_hyperrl_error():
    classes = _classes()

    def is_error(name: str, seen=()) -> bool:
        if name in BUILTIN or name == "HyperRLError":
            return True
        return name in classes and name not in seen and any(is_error(b, (*seen, name)) for b in classes[name][1])

    def has_base(name: str) -> bool:
        if name == "HyperRLError":
            return True
        return name in classes and any(has_base(b) for b in classes[name][1])

    errors = [n for n, (_, bases) in classes.items() if not n.startswith("_") and n != "HyperRLError"
              and any(is_error(b) for b in bases)]
    assert len(errors) >= 20, errors  # the checker sees them
    missing = sorted(f"{classes[n][0]}:{n}" for n in errors if not has_base(n))
    assert missing == [], f"error classes without HyperRLError: {missing}"


@pytest.mark.parametrize(("module", "name", "builtin"), [
    ("hyperrl.config", "ConfigError", ValueError), ("hyperrl.sharding.verify", "PlanError", ValueError),
    ("hyperrl.algorithms", "GateError", RuntimeError), ("hyperrl.rollout.base", "DeltaError", RuntimeError),
])
def test_errors_are_caught_by_the_base_and_by_their_builtin(module, name, builtin):
    import importlib

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, HyperRLError) and issubclass(cls, builtin)
    assert not issubclass(cls, AssertionError)  # `python -O` never strips a raised plan error's meaning
    with pytest.raises(HyperRLError, match="named"):
        raise cls("named")
