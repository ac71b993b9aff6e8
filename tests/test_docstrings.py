"""The public API documents itself: every module has a docstring and declares ``__all__``, every
name in an ``__all__`` exists, and every public class and function a module defines (a name without a
leading ``_``) has a docstring of its own — a dataclass's generated signature is not one. The test lists the
names that break this and fails."""

import dataclasses
import importlib
import inspect
import pkgutil

import hyperrl

# entry points and a module vLLM loads inside its workers: no public names to declare
_NO_ALL = {"hyperrl.cli", "hyperrl.sharding.cli", "hyperrl.rollout.vllm_worker", "hyperrl.demo"}
MODULES = ["hyperrl"] + sorted(m.name for m in pkgutil.walk_packages(hyperrl.__path__, "hyperrl."))


def _own_doc(obj) -> bool:
    """A docstring written for ``obj`` — not inherited, and not the signature a dataclass generates."""
    doc = ((obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__) or "").strip()
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return False
    return bool(doc)


def _undocumented() -> list[str]:
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        if not (mod.__doc__ or "").strip():
            out.append(f"{name} (module)")
        names = getattr(mod, "__all__", None)
        if names is None:
            if name not in _NO_ALL:
                out.append(f"{name} (no __all__)")
            continue
        for n in names:
            if not hasattr(mod, n):
                out.append(f"{name}.{n} (in __all__, not defined)")
        # every public class and function the module defines, in ``__all__`` or not
        for n, obj in vars(mod).items():
            if not n.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    and obj.__module__ == name and not _own_doc(obj):
                out.append(f"{name}.{n}")
    return out


def test_every_public_name_has_a_docstring():
    assert _undocumented() == []


def test_the_facade_names_resolve_and_are_documented():
    import hyperrl as hr

    for n in hr.__all__:
        obj = getattr(hr, n)
        assert (obj.__doc__ or "").strip(), n
    assert hr.build.__module__ == "hyperrl.compose" and hr.SyncTrainer.__module__ == "hyperrl.loop.trainer"


def test_the_checker_can_fail():
    class Bare:
        pass

    def documented():
        """Has one."""

    assert not _own_doc(Bare) and _own_doc(documented)

    trainer = importlib.import_module("hyperrl.loop.trainer").Trainer

    class Child(trainer):
        pass

    assert not _own_doc(Child) and _own_doc(trainer)  # an inherited docstring is not its own

    @dataclasses.dataclass(frozen=True)
    class Record:
        x: int

    assert not _own_doc(Record)  # the generated "Record(x: int)" is not a docstring
