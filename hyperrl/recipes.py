"""Recipes: named chains of primitives (shaping → filter → advantages → objective + aggregation +
KL + correction), selected in YAML by ``algo.recipe`` and overridden part by part.

A recipe is a config fragment for the ``algo`` section — only what differs from the factories'
own defaults — registered in ``RECIPES`` (its factory takes no hyperparameters and returns the
fragment). :func:`resolve` checks a loaded config against every registry and fills each variant
with its factory's defaults; :func:`build_pipeline` turns the resolved ``algo`` section into a
:class:`Pipeline` of bound components, which the loop calls and a user may replace or extend
in Python (``SyncTrainer(pipeline=...)``). docs/recipes.md lists each chain and the peer call it
reproduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .registry import HyperparameterError, Registry

__all__ = ["RECIPES", "register_recipe", "recipe_config", "resolve", "registries", "Pipeline", "build_pipeline",
           "TRAJECTORY_KEYS", "RUN_PRODUCES"]

RECIPES: Registry = Registry("recipe")
register_recipe = RECIPES.register

_PPO = {"name": "ppo_clip"}


def _recipe(name: str, doc: str, **algo):
    def fragment() -> dict:
        return dict(algo)

    fragment.__doc__ = doc
    RECIPES.add(name, fragment)


_recipe("grpo", "GRPO (Shao et al. 2024) as verl's default actor: group z-score (eps 1e-6, singleton raw), "
        "PPO clip 0.2 with dual clip 3, token-mean, k3 KL loss 0.001 clamped 20/10 (builds a reference).",
        advantage={"name": "grpo", "singleton": "raw"}, objective={**_PPO, "dual_clip": 3.0},
        agg="token-mean", kl={"coef": 0.001, "estimator": "k3", "clamp_input": 20.0, "clamp_output": 10.0})
_recipe("grpo_clip_higher", "The embedded default: GRPO advantages, PPO clip with DAPO clip-higher "
        "(0.2 / 0.28), token-mean, entropy bonus 0.1, no KL (the default arith task: see README's seeds table).",
        advantage="grpo", objective={**_PPO, "clip_high": 0.28}, agg="token-mean", entropy_coef=0.1)
_recipe("dr_grpo", "Dr. GRPO (Liu et al. 2025): s − μ_g (no std), PPO clip 0.2, seq-mean-token-sum-norm with the "
        "response budget as L_const (TRL loss_type=dr_grpo).",
        advantage="dr_grpo", objective=_PPO, agg="seq-mean-token-sum-norm")
_recipe("dapo", "DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-mean, soft overlong punishment, dynamic "
        "sampling with refill, no KL.",
        advantage="grpo", objective={**_PPO, "clip_high": 0.28}, agg="token-mean",
        shaping=[{"name": "overlong"}], filter="dynamic_sampling")
_recipe("gspo", "GSPO (Zheng et al. 2025): sequence-level ratio, clip 3e-4 / 4e-4, token-mean (verl 0.9.1 follows "
        "loss_agg_mode, default token-mean).", advantage="grpo", objective="gspo", agg="token-mean")
_recipe("gmpo", "GMPO (Zhao et al. 2025): geometric-mean ratio clipped in log space (0.4), seq-mean-token-mean.",
        advantage="grpo", objective="gmpo", agg="seq-mean-token-mean")
_recipe("cispo", "CISPO (MiniMax-M1): −sg(min(r, 5))·A·lp, token-mean (TRL loss_type=cispo).",
        advantage="grpo", objective="cispo", agg="token-mean")
_recipe("sapo", "SAPO (Qwen 2025): soft sigmoid gate τ = 1.0 / 1.05, seq-mean-token-mean (verl forces it).",
        advantage="grpo", objective="sapo", agg="seq-mean-token-mean")
_recipe("rloo", "RLOO (Ahmadian et al. 2024): leave-one-out baseline, PPO clip 0.2, token-mean.",
        advantage="rloo", objective=_PPO, agg="token-mean")
_recipe("reinforce_pp", "REINFORCE++ (Hu 2025): discounted return-to-go whitened over the batch, PPO clip 0.2.",
        advantage="reinforce_pp", objective=_PPO, agg="token-mean")
_recipe("reinforce_pp_baseline", "REINFORCE++-baseline: s − μ_g on tokens, batch-whitened, PPO clip 0.2.",
        advantage="reinforce_pp_baseline", objective=_PPO, agg="token-mean")
_recipe("remax", "ReMax (Li et al. 2023): return minus a greedy rollout's reward (the loop generates the greedy "
        "baseline), PPO clip 0.2.", advantage="remax", objective=_PPO, agg="token-mean")
_recipe("opo", "OPO: length-weighted group baseline, PPO clip 0.2, token-mean.",
        advantage="opo", objective=_PPO, agg="token-mean")
_recipe("gpg", "GPG (Chu et al. 2025): α·(s − μ_g), plain −A·lp (no ratio), token-mean.",
        advantage="gpg", objective="reinforce", agg="token-mean")
_recipe("gdpo", "GDPO / TRL multi_objective_aggregation=normalize_then_sum: each task reward (reward_components "
        "[B, K]) group-normalised, summed, batch-normalised; PPO clip 0.2.",
        advantage="normalize_then_sum", objective=_PPO, agg="token-mean")
_recipe("ppo", "PPO with a critic: GAE (γ 1, λ 1, whitened as verl always does), clipped value loss, PPO clip 0.2.",
        advantage="gae", objective=_PPO, agg="token-mean")


def recipe_config(name: str) -> dict:
    """The ``algo`` fragment of recipe ``name`` (a new dict)."""
    return {"recipe": name, **RECIPES.factory(name).fn()}


# ----------------------------------------------------------------------------- checking

# keys every trajectory batch has (hyperrl.trajectory) and those the loop can always produce
TRAJECTORY_KEYS = frozenset({"tokens", "attention_mask", "action_mask", "rollout_logprobs", "policy_version",
                             "group_id"})
# reward/reward_components: the task's rewards; old_logprobs: the learner's forward; values: a critic;
# ref_logprobs: a reference model; baseline_reward: a greedy rollout per prompt; token_rewards: the
# rewards' per-token split (RewardSet.token_rewards)
RUN_PRODUCES = frozenset({"reward", "reward_components", "old_logprobs", "values", "ref_logprobs",
                          "baseline_reward", "token_rewards"})


def registries() -> dict[str, Registry]:
    """Config key → the registry its variant names (imports every plug-in package)."""
    from . import transforms as T
    from .envs import ENVIRONMENTS, REWARDS, TOOLS
    from .rewards import REWARD_FACTORIES
    from .rollout.engines import ENGINES
    from .rollout.workers import EXECUTORS
    from .schedules import SCHEDULES
    from .tasks import TASKS

    return {"task": TASKS, "env": ENVIRONMENTS, "rollout.engine": ENGINES, "async.executor": EXECUTORS,
            "algo.advantage": T.ADVANTAGES,
            "algo.objective": T.OBJECTIVES, "algo.agg": T.AGGREGATIONS, "algo.kl.estimator": T.KL_ESTIMATORS,
            "algo.kl.controller": T.KL_CONTROLLERS, "algo.correction": T.CORRECTIONS, "algo.shaping": T.SHAPING,
            "algo.filter": T.FILTERS, "optim.schedule": SCHEDULES, "rewards": REWARDS, "rewards[].fn": REWARD_FACTORIES,
            "tools": TOOLS}


def _err(msg: str):
    from .config import ConfigError

    return ConfigError(msg)


def _check(reg: Registry, spec, key: str, context: dict | None = None):
    """A variant validated against its factory and completed with the factory's defaults."""
    from .config import Variant

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
    if cfg.optim.schedule not in regs["optim.schedule"]:
        raise _err(f"optim.schedule: unknown lr schedule {cfg.optim.schedule!r}; registered: "
                   f"{regs['optim.schedule'].names()}")
    # every key a component needs must be one the run can produce
    produced = TRAJECTORY_KEYS | RUN_PRODUCES | set(fadv.produces) | {"advantages"}
    parts = [("algo.advantage", fadv), ("algo.objective", fobj), ("algo.correction", corr[1]),
             *[(f"algo.shaping[{i}]", s[1]) for i, s in enumerate(shaping)], ("algo.filter", filt[1])]
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
                     filter=filt[0].spec() if filt[0] else None)
    d["algo"]["kl"]["controller"] = ctrl.spec()
    if cfg.rewards and "reward_components" in fadv.needs and "weights" in fadv.params and \
            d["algo"]["advantage"].get("weights") is None:  # GDPO: the rewards' weights, per component
        d["algo"]["advantage"]["weights"] = ([1.0] if cfg.env is not None else []) + [r.weight for r in cfg.rewards]
    return type(cfg).model_validate(d)


# ----------------------------------------------------------------------------- the chain


@dataclass(frozen=True)
class Pipeline:
    """The pre-update chain and the loss pieces of a resolved ``algo`` section, as bound components.

    ``admit``: batch → batch (reward shaping, in order); ``filter``: batch → (batch, dropped) or
    None (the loop refills); ``transform``: batch → batch with ``advantages`` (and ``returns``);
    ``objective`` / ``correction``: bound callables for :func:`hyperrl.transforms.policy_loss`;
    ``needs``: every batch key the components read.
    """

    admit: Callable
    filter: Callable | None
    transform: Callable
    objective: Callable
    agg: str
    correction: Callable | None
    kl_coef: float
    kl_estimator: str
    kl_clamp_input: float | None
    kl_clamp_output: float | None
    kl_controller: Callable
    entropy_coef: float
    needs: frozenset

    def loss_kwargs(self, beta: float) -> dict:
        """Keyword arguments of ``policy_loss`` (β from the KL controller's state)."""
        return dict(objective=self.objective, agg=self.agg, entropy_coef=self.entropy_coef, kl_coef=beta,
                    kl_estimator=self.kl_estimator, kl_clamp_input=self.kl_clamp_input,
                    kl_clamp_output=self.kl_clamp_output)


def build_pipeline(algo) -> Pipeline:
    """Bind every component of a resolved ``algo`` section (see :func:`resolve`)."""
    from . import transforms as T

    shaping = [T.SHAPING.factory(s.name) for s in algo.shaping]
    adv = T.ADVANTAGES.factory(algo.advantage.name)
    obj = T.OBJECTIVES.factory(algo.objective.name)
    corr = T.CORRECTIONS.factory(algo.correction.name) if algo.correction else None
    filt = T.FILTERS.factory(algo.filter.name) if algo.filter else None
    needs = set(adv.needs) | set(obj.needs) | set(corr.needs if corr else ()) | set(filt.needs if filt else ())
    needs |= {n for s in shaping for n in s.needs}
    if algo.kl.coef > 0:
        needs.add("ref_logprobs")
    adv_fn = T.bind(T.compute_advantages, estimator=adv.build(**algo.advantage.args))
    return Pipeline(
        admit=T.chain(*[f.build(**s.args) for f, s in zip(shaping, algo.shaping)]),
        filter=filt.build(**algo.filter.args) if filt else None,
        transform=T.chain(adv_fn),
        objective=obj.build(**algo.objective.args),
        agg=algo.agg.name,
        correction=corr.build(**algo.correction.args) if corr else None,
        kl_coef=algo.kl.coef, kl_estimator=algo.kl.estimator, kl_clamp_input=algo.kl.clamp_input,
        kl_clamp_output=algo.kl.clamp_output,
        kl_controller=T.KL_CONTROLLERS.build(algo.kl.controller.name, **algo.kl.controller.args),
        entropy_coef=algo.entropy_coef, needs=frozenset(needs))
