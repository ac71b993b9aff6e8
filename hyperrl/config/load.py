"""Loading a config: defaults ← recipe ← YAML file ← ``--a.b=value`` overrides, then every check.

Merging keeps a variant's arguments of the layer below only while its name stays the same, so
``--algo.objective=gspo`` gets GSPO's clips, never PPO's. After pydantic has validated types and
keys, :mod:`hyperrl.config.checks` runs every config-shaped check and
:func:`hyperrl.config.resolve.resolve` checks each variant against its registry — all before any
model, engine, process group or ``out_dir`` exists.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from hyperrl.config import yaml12
from hyperrl.config.checks import check_combinations, check_config
from hyperrl.config.compare import BOOKKEEPING, flatten
from hyperrl.config.recipes import RECIPES, recipe_config
from hyperrl.config.resolve import registries, resolve
from hyperrl.config.schema import AlgoConfig, ConfigError, TrainConfig, Variant, _plain
from hyperrl.tokenizer import is_template_file

__all__ = ["load_config", "validate_config", "describe", "CHECKPOINT_SETTINGS"]


def _is_variant(annotation) -> bool:
    """``Variant`` or ``Variant | None`` (not ``list[Variant]``: lists are replaced whole)."""
    return annotation is Variant or (get_origin(annotation) in (Union, UnionType) and Variant in get_args(annotation))


def _as_spec(v):
    return {"name": v} if isinstance(v, str) else v


def _merge(model: type[BaseModel], base: dict, over: dict) -> dict:
    """``over`` on ``base`` (plain dicts): sections recurse, variants keep ``base``'s arguments only
    while the name is unchanged, everything else (lists included) is replaced."""
    out = dict(base)
    for k, v in over.items():
        f = model.model_fields.get(k)
        sub = getattr(f, "annotation", None) if f else None
        if f is not None and isinstance(sub, type) and issubclass(sub, BaseModel) and sub is not Variant \
                and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(sub, out[k], v)
        elif f is not None and _is_variant(sub) and isinstance(_as_spec(v), dict) and \
                isinstance(_as_spec(out.get(k)), dict):
            b, o = _as_spec(out[k]), _as_spec(v)
            out[k] = o if "name" in o and o["name"] != b.get("name") else {**b, **o}
        else:
            out[k] = v
    return out


def _overrides(items: list[str]) -> dict:
    data: dict = {}
    for item in items:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected --section.key=value")
        key, raw = item.split("=", 1)
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            if isinstance(node.get(part), str):  # --algo.objective=gspo --algo.objective.clip_low=…
                node[part] = {"name": node[part]}
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = yaml12.load(raw) if raw != "" else ""
        except yaml12.DuplicateKeyError as e:
            raise ConfigError(f"override {key!r}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key!r}: {raw!r} is not a YAML value ({e.problem})") from None
    return data


def _dotted(loc) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p in ("args",)))


def _pydantic_error(e: ValidationError) -> ConfigError:
    err = e.errors()[0]
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = _dotted(loc)
    if err["type"] == "extra_forbidden":
        parent = TrainConfig
        for p in loc[:-1]:
            f = parent.model_fields.get(str(p)) if isinstance(parent, type) else None
            parent = f.annotation if f is not None else None
        valid = sorted(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        where = ".".join(map(str, loc[:-1])) or "the top level"
        return ConfigError(f"unknown config key {key!r}; valid keys under {where}: {valid}")
    return ConfigError(f"{key}: {err.get('input')!r} is not valid — {err['msg']}")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults ← recipe ← YAML file ← ``--a.b=value`` overrides; then every variant checked
    against its registry (see the module doc). Raises :class:`ConfigError`."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml12.load(p.read_text()) or {}
        except yaml12.DuplicateKeyError as e:
            raise ConfigError(f"{p}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    over = _overrides(list(overrides))
    for layer in (data, over):
        for section in ("algo", "rollout", "optim", "run", "model"):
            if section in layer and not isinstance(layer[section], dict):
                raise ConfigError(f"{section}: expected a mapping, got {type(layer[section]).__name__}")
    recipe = over.get("algo", {}).get("recipe", data.get("algo", {}).get("recipe", AlgoConfig().recipe))
    try:
        base = {"algo": recipe_config(recipe)}
    except KeyError as e:
        raise ConfigError(f"algo.recipe: {e.args[0]}") from None
    merged = TrainConfig().to_dict()
    for layer in (base, data, over):
        merged = _merge(TrainConfig, merged, layer)
    merged = _data_task(merged, explicit_task="task" in data or "task" in over)
    user = set(flatten(data)) | set(flatten(over))
    merged = _settings(merged, user)
    for key in ("checkpoint", "tokenizer", "chat_template"):  # paths recorded absolute: `hyperrl export` and
        if merged["model"].get(key) and (key != "chat_template" or is_template_file(merged["model"][key])):
            merged["model"] = {**merged["model"], key: str(Path(merged["model"][key]).resolve())}  # resume anywhere
    if "run.out_dir" not in user:
        default = _merge(TrainConfig, TrainConfig().to_dict(), {"algo": recipe_config(AlgoConfig().recipe)})
        merged["run"]["out_dir"] = _out_dir(merged, default, p.stem if path is not None else None)
    return validate_config(merged)


# A local checkpoint is a pretrained model: the toy task's learning rate (1e-3, for random weights)
# would wreck it. 1e-6 is verl's actor and TRL's GRPOConfig default.
CHECKPOINT_SETTINGS = {"optim.lr": 1e-6}

# run.* keys that do not change what a run trains: a config that differs only in these keeps its
# output directory (a longer run.steps resumes the same run)
_NOT_IDENTITY = tuple(k.split(".", 1)[1] for k in BOOKKEEPING) + ("device",)


def _set(d: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for p in parents:
        d = d[p]
    d[last] = value


def _settings(d: dict, user: set[str]) -> dict:
    """The keys the task's factory declares (``settings``) and, with ``model.checkpoint``,
    :data:`CHECKPOINT_SETTINGS` — for every such key the user left unset (schema defaults are the
    embedded arith task's)."""
    import copy

    from hyperrl.data.tasks import TASKS

    task = _as_spec(d.get("task"))
    name = task.get("name") if isinstance(task, dict) else None
    settings = dict(TASKS.factory(name).settings) if name in TASKS else {}
    if (d.get("model") or {}).get("checkpoint"):
        settings.update(CHECKPOINT_SETTINGS)
    todo = {k: v for k, v in settings.items() if k not in user}
    if not todo:
        return d
    d = copy.deepcopy(d)
    for k, v in todo.items():
        _set(d, k, v)
    return d


def _identity(d: dict) -> str:
    """A short hash of what a run trains (everything but :data:`_NOT_IDENTITY`)."""
    import hashlib
    import json

    run = {k: v for k, v in (d.get("run") or {}).items() if k not in _NOT_IDENTITY}
    blob = json.dumps({**d, "run": run}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def _out_dir(d: dict, default: dict, stem: str | None) -> str:
    """``run.out_dir`` when unset: ``runs/default`` for the embedded default (differing at most in
    :data:`_NOT_IDENTITY`), else ``runs/<config file's stem or task>-<hash of the config>`` — the
    same command resumes its own run; a different model, task or hyperparameter never lands in
    another run's directory."""
    if stem is None and _identity(d) == _identity(default):
        return default["run"]["out_dir"]
    task = _as_spec(d.get("task"))
    name = stem or (task.get("name") if isinstance(task, dict) else None) or "run"
    return f"runs/{name}-{_identity(d)}"


def validate_config(data: dict) -> TrainConfig:
    """A complete config as plain data (``TrainConfig.to_dict()``'s form) → the checked, resolved
    config: pydantic's types and keys, every config-shaped check, every variant against its
    registry. Raises :class:`ConfigError`."""
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as e:
        raise _pydantic_error(e) from None
    check_config(cfg)
    cfg = resolve(cfg)
    check_combinations(cfg)
    return cfg


def _data_task(d: dict, *, explicit_task: bool) -> dict:
    """``data.train_files`` set → the task is ``files`` built from the data section (``preference`` —
    pairs — when ``algo.preference`` is set, as the recipes ``dpo`` / ``ipo`` do)."""
    data = d.get("data") or {}
    if not isinstance(data, dict) or not data.get("train_files"):
        if isinstance(data, dict) and data.get("val_files"):
            raise ConfigError("data.val_files: set data.train_files too (validation data belongs to a files task)")
        return d
    keys = ("train_files", "val_files", "prompt_key", "max_prompt_length", "overlong_prompts", "apply_chat_template")
    if (d.get("algo") or {}).get("preference"):  # pairs, not prompts: DPO and kin
        task = {"name": "preference", **{k: data[k] for k in keys + ("chosen_key", "rejected_key") if k in data}}
    else:
        task = {"name": "files", **{k: data[k] for k in keys + ("rewards", "image_root") if k in data}}
    if explicit_task:
        given = d.get("task") if isinstance(d.get("task"), dict) else {}
        if given.get("name") == task["name"] and list(given.get("train_files") or []) == list(data["train_files"]):
            return d  # the task these files build, written out (a run's config.json reloads to itself)
        raise ConfigError(f"data.train_files and task are both set: data.train_files builds the task ({task['name']}); "
                          "remove task, or drop data.train_files and use the task's own arguments")
    return {**d, "task": task}


def describe() -> str:
    """Every key with its default and one line of doc, then every registered variant with its
    hyperparameters (``hyperrl config``)."""
    lines = []

    def walk(inst, prefix: str):
        for name, f in type(inst).model_fields.items():
            v = getattr(inst, name)
            if isinstance(v, BaseModel) and not isinstance(v, Variant):
                walk(v, f"{prefix}{name}.")
                continue
            shown = _plain(v)
            lines.append(f"{prefix}{name} = {shown!r}" + (f"  # {f.description}" if f.description else ""))

    walk(load_config(), "")
    lines.append("")
    lines.append("Variants (a section names one: {name: x, arg: value}); the factory's defaults:")
    for key, reg in registries().items():
        lines.append(f"{key}: {reg.kind}")
        for n in reg.names():
            f = reg.factory(n)
            args = ", ".join(f"{p.name}={p.default!r}" if not p.required else f"{p.name} (required)"
                             for p in f.params.values())
            needs = f"  needs {list(f.needs)}" if f.needs else ""
            lines.append(f"  {n}({args}){needs}")
    lines.append("Settings a task (or a model.checkpoint) applies to keys the config leaves unset:")
    from hyperrl.data.tasks import TASKS

    for n in TASKS.names():
        if TASKS.factory(n).settings:
            lines.append(f"  task {n}: {TASKS.factory(n).settings}")
    lines.append(f"  model.checkpoint set: {CHECKPOINT_SETTINGS}")
    lines.append("algo.recipe: named chains")
    for n in RECIPES.names():
        lines.append(f"  {n}: {RECIPES.factory(n).doc}")
    return "\n".join(lines)
