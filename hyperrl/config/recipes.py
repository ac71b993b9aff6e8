"""Recipes: named chains of primitives (shaping → filter → advantages → objective + aggregation +
KL + correction), selected in YAML by ``algo.recipe`` and overridden part by part — optax's aliases.

A recipe is a config fragment for the ``algo`` section — only what differs from the factories'
own defaults — registered in ``RECIPES`` (its factory takes no hyperparameters and returns the
fragment). :func:`hyperrl.config.resolve.resolve` checks a loaded config against every registry
and fills each variant with its factory's defaults; :func:`hyperrl.loop.pipeline.build_pipeline`
turns the resolved ``algo`` section into bound components. docs/recipes.md lists each chain and
the peer call it reproduces.
"""

from __future__ import annotations

from hyperrl.registry import Registry

__all__ = ["RECIPES", "register_recipe", "recipe_config"]

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
_recipe("dppo", "DPPO-Binary-TV (arXiv 2602.04879) as verl 0.9 loss_mode=dppo_tv: GRPO advantages, the sampled "
        "token's probability kept within ±0.2 of the old one on the side of its advantage, truncated IS at 3, "
        "token-mean.", advantage="grpo", objective="dppo_tv", agg="token-mean")
_recipe("topr", "TOPR (Le Roux et al. 2025; ROLL): −A·lp on positive samples, −sg(clip(π/μ, 0, 1))·A·lp on the "
        "rest (per-token ratio, as ROLL), R = s − μ_g (a group-mean baseline, no std), token-mean.",
        advantage="dr_grpo", objective="topr", agg="token-mean")
_recipe("m2po", "M2PO (arXiv 2510.01161; AReaL gsm8k_m2po): GRPO advantages, PPO clip 0.2, token-mean, the tokens "
        "with the largest (log π_behave − log π_prox)² over the whole step dropped until their mean < 0.04 "
        "(m2_threshold; correction m2po_local: AReaL's per-micro-batch scope).",
        advantage="grpo", objective=_PPO, agg="token-mean", correction={"name": "m2po", "tau": 0.04})
_recipe("opsm", "OPSM (DeepSeek-V3.2; slime --use-opsm): GRPO advantages, PPO clip 0.2, token-mean, sequences with "
        "A < 0 and mean log(μ/π_θ) > 1e-4 dropped.",
        advantage="grpo", objective=_PPO, agg="token-mean", correction={"name": "opsm", "delta": 1e-4})
_recipe("dpo", "DPO (Rafailov et al. 2023) on preference pairs (data.train_files: prompt / chosen / rejected) "
        "against a frozen reference, β 0.1 (TRL DPOConfig loss_type=sigmoid; label_smoothing: conservative DPO as "
        "OpenRLHF).", preference={"name": "dpo"})
_recipe("ipo", "IPO (Azar et al. 2023) on preference pairs: (Δ/|y| − 1/(2β))², log-ratios averaged per token "
        "(TRL loss_type=ipo), β 0.1.", preference={"name": "ipo"})
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


# ----------------------------------------------------------------------------- the chain


