"""One registry contract for every kind of plug-in (advantages, objectives, engines, tasks, ...).

A registry maps a name to a :class:`Factory`: the registered callable plus what it declares —
its **hyperparameters** (the callable's keyword-only parameters: name, type, default; the
factory's defaults are the only defaults), the batch keys it **needs** and **produces**. Runtime
inputs (a batch, log-probs, a policy) are the positional parameters and are not configurable.
``Factory.build(**hyperparams)`` validates the values and returns the component (the callable
with its hyperparameters bound), so a config can be checked — every name, argument and type —
before anything is built. Unknown names raise a ``KeyError`` listing the registered ones.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar, get_type_hints

from pydantic import Field

from hyperrl.errors import HyperRLError

F = TypeVar("F", bound=Callable)

__all__ = ["Registry", "Factory", "Param", "HyperparameterError", "NonNegative", "Positive", "PositiveInt",
           "Fraction", "AboveOne"]

# Declared ranges for a factory's hyperparameters (annotate a keyword-only parameter with one):
# checked with the value's type at load, the error naming the key and the range. Every float is
# finite whatever its annotation (a NaN or infinite hyperparameter is never accepted).
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(ge=1)]
Fraction = Annotated[float, Field(ge=0, le=1)]
AboveOne = Annotated[float, Field(gt=1)]


class HyperparameterError(HyperRLError, ValueError):
    """A hyperparameter a factory does not take, or a value of the wrong type; the message names both."""


@dataclass(frozen=True)
class Param:
    """One hyperparameter of a factory (a keyword-only parameter of its callable): ``name``, type
    ``annotation``, ``default`` (``required`` when it has none) and an optional ``doc``."""

    name: str
    annotation: Any  # a type (from the signature, or inferred from the default); Any when unknown
    default: Any  # inspect.Parameter.empty when required
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


def _annotation(p: inspect.Parameter, hints: dict) -> Any:
    if p.name in hints:
        return hints[p.name]
    d = p.default
    if d is inspect.Parameter.empty or d is None:
        return Any
    if isinstance(d, bool):
        return bool
    if isinstance(d, float):
        return float
    if isinstance(d, int):
        return int
    return type(d)


def _validate(value: Any, annotation: Any, where: str) -> Any:
    """Check (and losslessly coerce: int → float) ``value`` against ``annotation`` with pydantic;
    a NaN or infinite float is refused whatever the annotation, and a boolean where a number goes."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        raise HyperparameterError(f"{where}: {value!r} is not a finite number")
    if isinstance(value, bool) and annotation is not bool and _numeric(annotation):
        raise HyperparameterError(f"{where}: expected a number, got the boolean {value}")
    if annotation is Any:
        return value
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(annotation).validate_python(value, strict=False)
    except ValidationError as e:
        msg = "; ".join(err["msg"] for err in e.errors())
        raise HyperparameterError(f"{where}: {value!r} is not a valid {_type_name(annotation)} ({msg})") from None
    except Exception:  # noqa: BLE001 - a type pydantic cannot describe: accept as given
        return value


def _numeric(t: Any) -> bool:
    from typing import get_args, get_origin

    if get_origin(t) is Annotated:
        return _numeric(get_args(t)[0])
    return t in (int, float) or any(a in (int, float) for a in get_args(t))


def _type_name(t: Any) -> str:
    from typing import get_args, get_origin

    if get_origin(t) is Annotated:
        return _type_name(get_args(t)[0])
    args = [a for a in get_args(t) if a is not type(None)]
    if args and len(args) < len(get_args(t)):  # X | None
        return " | ".join(_type_name(a) for a in args) + " or None"
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


@dataclass(frozen=True)
class Factory:
    """A registered plug-in: ``build(**hyperparams) -> component`` plus its declarations."""

    kind: str
    name: str
    fn: Callable
    needs: tuple[str, ...] = ()  # batch keys the component reads beyond the trajectory contract
    produces: tuple[str, ...] = ()  # batch keys it writes
    requires: tuple[str, ...] = ()  # importable modules it needs, with the install hint (module, hint)
    doc: str = ""
    params: dict[str, Param] = field(default_factory=dict)
    # config keys (dotted) this plug-in sets when the user leaves them unset — e.g. a task's response
    # budget; applied at load (:func:`hyperrl.load_config`), listed by ``hyperrl config``
    settings: dict[str, Any] = field(default_factory=dict)
    # what the plug-in can do, declared where it registers (never probed on the built object): a record, or a
    # function of its hyperparameters returning one (an engine's capabilities depend on its arguments)
    capabilities: Any = None
    # a check of the hyperparameters together, beyond each one's type (e.g. an engine's transport runs in this
    # process): called with them all (defaults filled), raising ValueError whose message starts ``arg=value: ``
    validate: Callable | None = None

    def capabilities_for(self, args: dict | None = None) -> Any:
        """The declared capabilities for hyperparameters ``args`` (the registry's default record when the plug-in
        declared none)."""
        c = self.capabilities
        return c(**(args or {})) if callable(c) else c

    def check(self, args: dict, where: str = "") -> dict:
        """Validated hyperparameters (unknown names and wrong types raise, naming ``where.arg``)."""
        where = where or f"{self.kind} {self.name!r}"
        unknown = sorted(set(args) - set(self.params))
        if unknown:
            allowed = ", ".join(f"{p.name}={p.default!r}" if not p.required else p.name
                                for p in self.params.values()) or "none"
            raise HyperparameterError(f"{where}.{unknown[0]}: {self.kind} {self.name!r} takes no argument "
                                      f"{unknown[0]!r}; its hyperparameters: {allowed}")
        missing = [p.name for p in self.params.values() if p.required and p.name not in args]
        if missing:
            raise HyperparameterError(f"{where}.{missing[0]}: {self.kind} {self.name!r} needs {missing[0]!r} "
                                      f"(a {_type_name(self.params[missing[0]].annotation)}); set it in the config")
        out = {k: _validate(v, self.params[k].annotation, f"{where}.{k}") for k, v in args.items()}
        if self.validate is not None:
            try:
                self.validate(**{**self.defaults(), **out})
            except ValueError as e:
                raise HyperparameterError(f"{where}.{e}") from None
        return out

    def check_requirements(self, where: str = "") -> None:
        """Every module the factory ``requires`` is importable, else an error naming it and the install."""
        import importlib.util

        for module, hint in self.requires:
            if importlib.util.find_spec(module) is None:
                raise HyperparameterError(f"{where or self.kind}={self.name}: {module} is not installed in this "
                                          f"environment — {hint}")

    def defaults(self) -> dict:
        return {p.name: p.default for p in self.params.values() if not p.required}

    def build(self, _where: str = "", **hyperparams) -> Callable:
        """The component: ``fn`` with its (validated) hyperparameters bound."""
        kw = self.check(hyperparams, _where)
        return functools.partial(self.fn, **kw) if kw else self.fn


def _params(fn: Callable) -> dict[str, Param]:
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        sig = inspect.signature(fn)
        hints = get_type_hints(target, include_extras=True)
    except (TypeError, ValueError, NameError):
        return {}
    return {p.name: Param(p.name, _annotation(p, hints), p.default)
            for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


class Registry(Generic[F]):
    """A named mapping ``name -> Factory`` for one kind of plug-in."""

    def __init__(self, kind: str, *, capabilities: Any = None):
        self.kind = kind
        self.default_capabilities = capabilities  # what a plug-in of this kind declaring none can do
        self._items: dict[str, Factory] = {}

    def register(self, name: str, *, needs: tuple[str, ...] = (), produces: tuple[str, ...] = (),
                 requires: tuple[tuple[str, str], ...] = (), settings: dict[str, Any] | None = None,
                 capabilities: Any = None, validate: Callable | None = None,
                 overwrite: bool = False) -> Callable[[F], F]:
        """Decorator: ``@REG.register("my_variant", needs=("values",))`` adds ``fn`` under ``name``;
        its keyword-only parameters are its hyperparameters; ``capabilities``: what it can do (a record of the
        registry's kind, or a function of the hyperparameters returning one); ``validate``: a check of the
        hyperparameters together, run wherever they are checked (:meth:`Factory.check`: at load). Returns ``fn``
        unchanged."""

        def deco(fn: F) -> F:
            self.add(name, fn, needs=needs, produces=produces, requires=requires, settings=settings,
                     capabilities=capabilities, validate=validate, overwrite=overwrite)
            return fn

        return deco

    def add(self, name: str, fn: Callable, *, needs=(), produces=(), requires=(), settings=None,
            capabilities: Any = None, validate: Callable | None = None, overwrite: bool = False) -> Factory:
        """Register ``fn`` under ``name`` (see :meth:`register`); returns its :class:`Factory`."""
        if name in self._items and not overwrite:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
        doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
        f = Factory(self.kind, name, fn, tuple(needs), tuple(produces), tuple(requires), doc, _params(fn),
                    dict(settings or {}), capabilities if capabilities is not None else self.default_capabilities,
                    validate)
        self._items[name] = f
        return f

    def remove(self, name: str) -> Factory:
        """Unregister ``name`` (a plug-in registered for one test or one notebook); returns its factory."""
        try:
            return self._items.pop(name)
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._items)}") from None

    def factory(self, name: str) -> Factory:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {sorted(self._items)}") from None

    def get(self, name: str | F) -> F:
        """The registered callable itself (a callable passes through unchanged)."""
        if callable(name):
            return name
        return self.factory(name).fn

    def build(self, name: str, **hyperparams) -> Callable:
        """``factory(name).build(**hyperparams)``."""
        return self.factory(name).build(**hyperparams)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def in_order(self) -> list[str]:
        """The registered names in registration order (the order a plug-in kind runs in, where it matters)."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
