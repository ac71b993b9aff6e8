"""Resolution: every variant of a validated config checked against its registry and completed with
its factory's defaults; every batch key a component needs checked producible."""

from __future__ import annotations

from hyperrl.config.schema import ConfigError, Variant
from hyperrl.registry import HyperparameterError, Registry
from hyperrl.trajectory import RUN_PRODUCES, TRAJECTORY_KEYS

__all__ = ["registries", "resolve"]


def registries() -> dict[str, Registry]:
    """Config key → the registry its variant names (imports every plug-in package)."""
    import hyperrl.agents  # noqa: F401 - registers the "agent" environment
    from hyperrl import transforms as T
    from hyperrl.algorithms import LOSS_TERMS
    from hyperrl.data.tasks import TASKS
    from hyperrl.envs import ENVIRONMENTS, TOOLS
    from hyperrl.rewards import REWARDS
    from hyperrl.rollout.engines import ENGINES
    from hyperrl.rollout.workers import EXECUTORS
    from hyperrl.transforms.schedules import LR_SCHEDULES

    return {"task": TASKS, "env": ENVIRONMENTS, "rollout.engine": ENGINES, "async.executor": EXECUTORS,
            "algo.advantage": T.ADVANTAGES,
            "algo.objective": T.OBJECTIVES, "algo.agg": T.AGGREGATIONS, "algo.kl.estimator": T.KL_ESTIMATORS,
            "algo.kl.controller": T.KL_CONTROLLERS, "algo.correction": T.CORRECTIONS, "algo.shaping": T.SHAPING,
            "algo.filter": T.FILTERS, "algo.loss_terms": LOSS_TERMS, "algo.preference": T.PREFERENCE_LOSSES,
            "optim.schedule": LR_SCHEDULES,
            "rewards[].fn": REWARDS, "tools": TOOLS}


def _err(msg: str) -> ConfigError:
    return ConfigError(msg)


def _check(reg: Registry, spec, key: str, context: dict | None = None):
    """A variant validated against its factory and completed with the factory's defaults."""
    try:
        f = reg.factory(spec.name)
    except KeyError as e:
        raise _err(f"{key}: {e.args[0]}") from None
    args = dict(spec.args)
    for k, v in (context or {}).items():  # run-level values a factory may take (e.g. max_len)
        if k in f.params and k not in args:
            args[k] = v
    try:
        args = f.check(args, key)
        f.check_requirements(key)
    except HyperparameterError as e:
        raise _err(str(e)) from None
    return Variant(name=spec.name, args={**f.defaults(), **args}), f


def resolve(cfg):
    """Check every variant of a validated config against its registry; return the config with
    each variant's arguments completed by its factory's defaults. Raises ``ConfigError``."""
    regs = registries()
    a = cfg.algo
    task, _ = _check(regs["task"], cfg.task, "task")
    env = _check(regs["env"], cfg.env, "env")[0] if cfg.env is not None else None
    engine, _ = _check(regs["rollout.engine"], cfg.rollout.engine, "rollout.engine")
    executor, _ = _check(regs["async.executor"], getattr(cfg, "async").executor, "async.executor")
    adv, fadv = _check(regs["algo.advantage"], a.advantage, "algo.advantage")
    obj, fobj = _check(regs["algo.objective"], a.objective, "algo.objective")
    agg, _ = _check(regs["algo.agg"], a.agg, "algo.agg")
    ctrl, _ = _check(regs["algo.kl.controller"], a.kl.controller, "algo.kl.controller")
    est = a.kl.estimator[:-1] if a.kl.estimator.endswith("+") else a.kl.estimator
    if est not in regs["algo.kl.estimator"]:
        raise _err(f"algo.kl.estimator: unknown KL estimator {a.kl.estimator!r}; registered: "
                   f"{regs['algo.kl.estimator'].names()} (a '+' suffix makes it straight-through)")
    corr = _check(regs["algo.correction"], a.correction, "algo.correction") if a.correction else (None, None)
    ctx = {"max_len": cfg.rollout.max_new_tokens}
    shaping = [_check(regs["algo.shaping"], s, f"algo.shaping[{i}]", ctx) for i, s in enumerate(a.shaping)]
    filt = _check(regs["algo.filter"], a.filter, "algo.filter") if a.filter else (None, None)
    from hyperrl.algorithms.terms import BUILT_IN

    for i, t in enumerate(a.loss_terms):
        if t.name in BUILT_IN:
            raise _err(f"algo.loss_terms[{i}]: loss term {t.name!r} is built in — the pipeline lists it for "
                       f"{BUILT_IN[t.name]}; name only added terms here")
    terms = [_check(regs["algo.loss_terms"], t, f"algo.loss_terms[{i}]") for i, t in enumerate(a.loss_terms)]
    pref = _check(regs["algo.preference"], a.preference, "algo.preference")[0] if a.preference else None
    if cfg.optim.schedule not in regs["optim.schedule"]:
        raise _err(f"optim.schedule: unknown lr schedule {cfg.optim.schedule!r}; registered: "
                   f"{regs['optim.schedule'].names()}")
    # every key a component needs must be one the run can produce
    from hyperrl.algorithms import KEY_PROVIDERS

    produced = TRAJECTORY_KEYS | RUN_PRODUCES | set(fadv.produces) | {"advantages"} | \
        {k for n in KEY_PROVIDERS for k in (n, *KEY_PROVIDERS.factory(n).produces)}
    parts = [("algo.advantage", fadv), ("algo.objective", fobj), ("algo.correction", corr[1]),
             *[(f"algo.shaping[{i}]", s[1]) for i, s in enumerate(shaping)], ("algo.filter", filt[1]),
             *[(f"algo.loss_terms[{i}]", t[1]) for i, t in enumerate(terms)]]
    for key, f in parts:
        for need in (f.needs if f else ()):
            if need not in produced:
                raise _err(f"{key}: {f.kind} {f.name!r} needs batch key {need!r}, which this run does not produce "
                           f"(it produces {sorted(produced)}); choose another {key.split('.')[-1]} or add a "
                           f"component that produces it")
    if "values" in fadv.needs and "returns" not in fadv.produces:
        raise _err(f"algo.advantage: {fadv.name!r} needs a critic's values but produces no 'returns' for the "
                   f"critic's loss")
    d = cfg.to_dict()
    d["task"], d["env"] = task.spec(), env.spec() if env else None
    d["rollout"]["engine"] = engine.spec()
    d["async"]["executor"] = executor.spec()
    d["algo"].update(advantage=adv.spec(), objective=obj.spec(), agg=agg.spec(),
                     correction=corr[0].spec() if corr[0] else None, shaping=[s[0].spec() for s in shaping],
                     loss_terms=[t[0].spec() for t in terms],
                     filter=filt[0].spec() if filt[0] else None, preference=pref.spec() if pref else None)
    d["algo"]["kl"]["controller"] = ctrl.spec()
    if cfg.rewards and "reward_components" in fadv.needs and "weights" in fadv.params and \
            d["algo"]["advantage"].get("weights") is None:  # GDPO: the rewards' weights, per component
        d["algo"]["advantage"]["weights"] = ([1.0] if cfg.env is not None else []) + [r.weight for r in cfg.rewards]
    return type(cfg).model_validate(d)
