"""Checks that need what was built — the task, the models, the parallel dimensions — in one place: the composition
root calls :func:`check_built` once the models exist and before any parallelism is applied, so a config the built
pieces cannot run is refused naming the key and the fix (every check that needs only the config is
:mod:`hyperrl.config.checks`', at load)."""

from __future__ import annotations

from hyperrl.config.schema import ConfigError, TrainConfig
from hyperrl.routing import is_moe

__all__ = ["check_built", "check_teachers"]


def check_built(cfg: TrainConfig, *, task, policy, dims=None, critic: bool = False) -> None:
    """Every post-build check, before any parallelism is applied or an engine started: the task's answers fit the
    response budget, expert and context parallelism and packing suit the built policy (``critic``: one will be built),
    and the longest sequence fits the model's context. Raises :class:`ConfigError` naming the key and the fix."""
    _check_budget(cfg, task)
    if dims is not None and dims.ep > 1:
        _check_expert_parallel(cfg, policy, critic, dims.ep)
    if dims is not None and dims.cp > 1 and dims.world > 1:
        _check_context_parallel(policy, dims.cp, attention=dims.cp_attention, tp=dims.tp)
    _check_packing(cfg, policy)
    _check_context(cfg, task, policy)


def _check_packing(cfg: TrainConfig, policy) -> None:
    """``optim.pack_tokens``: packed rows keep to themselves only where transformers builds the attention mask from
    the position ids restarting at each row (``masking_utils``, the families on its attention interface) — a family
    with attention code of its own would let one row attend to another silently."""
    if cfg.optim.pack_tokens and not getattr(policy, "_supports_attention_backend", False):
        raise ConfigError(f"optim.pack_tokens={cfg.optim.pack_tokens}: {type(policy).__name__} cannot take packed "
                          "sequences (its attention does not go through transformers' attention interface, which "
                          "masks each packed row off the others); set optim.pack_tokens=0")


def _check_budget(cfg: TrainConfig, task) -> None:
    """The response budget holds the task's longest answer (multi-turn too: the answer turn needs the room)."""
    need = task.limits().response_tokens
    if cfg.rollout.max_new_tokens < need:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: task {cfg.task.name!r} has answers "
                          f"of up to {need - 1} tokens + EOS; set rollout.max_new_tokens ≥ {need}")


def _check_expert_parallel(cfg: TrainConfig, policy, critic: bool, ep: int) -> None:
    """``run.ep > 1`` trains an MoE policy (and a reference) — not a dense one, LoRA, a critic or checkpointing."""
    why = [w for w, bad in (("the policy is dense (model.experts=0)", not is_moe(policy)),
                            ("model.lora", cfg.model.lora is not None), ("a critic", critic),
                            ("model.gradient_checkpointing", cfg.model.gradient_checkpointing)) if bad]
    if why:
        raise ConfigError(f"run.ep={ep}: expert parallelism here trains an MoE policy (and a reference) — not "
                          f"with {', '.join(why)}; set run.ep=1")


def check_teachers(teachers: dict, dims) -> None:
    """Distillation teachers under ``run.cp > 1``: each runs its forwards sliced over the cp ranks as the policy
    does, so each must take Ulysses attention too (:func:`_check_context_parallel`, naming the teacher)."""
    if dims is not None and dims.cp > 1 and dims.world > 1:
        for key, teacher in teachers.items():
            name = "algo.distill.teacher" if key is None else f"algo.distill.teachers.{key}"
            _check_context_parallel(teacher, dims.cp, f"the teacher ({name}), {type(teacher).__name__},",
                                    attention=dims.cp_attention)


def _check_context_parallel(policy, cp: int, who: str | None = None, attention: str = "ulysses",
                            tp: int = 1) -> None:
    """``run.cp > 1``: Ulysses or ring attention needs transformers' attention interface; Ulysses heads that ``cp``
    divides (a TP rank's ``heads / tp`` under tensor parallelism: ``tp`` is 1 for a whole copy, a teacher)."""
    name = who or type(policy).__name__
    if not getattr(policy, "_supports_attention_backend", False):
        raise ConfigError(f"run.cp={cp}: {name} has no context-parallel plan (its attention does not use "
                          f"transformers' attention interface, which {attention} attention plugs into); set run.cp=1")
    if attention != "ulysses":
        return
    heads = policy.config.num_attention_heads // tp
    if heads % cp:
        each = f" a rank holds under run.tp={tp}" if tp > 1 else ""
        raise ConfigError(f"run.cp={cp} does not divide the attention heads{each} ({heads}) of {name}: Ulysses "
                          "attention splits the heads over the cp ranks — set run.cp_attention=ring (any cp)")
    from hyperrl.config.checks import _warn_kv_heads

    _warn_kv_heads(f"run.cp={cp}", (getattr(policy.config, "num_key_value_heads", None) or heads * tp) // tp, cp,
                   f"{name}'s num_key_value_heads")


def _check_context(cfg: TrainConfig, task, policy) -> None:
    """The longest prompt (a files task encodes every prompt once) plus the response budget — or a
    multi-turn episode's token budget — fits the model's context (``max_position_embeddings``;
    vLLM refuses longer sequences and a RoPE model past it generates from positions it never saw)."""
    ctx = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    if not ctx:
        return
    r = cfg.rollout
    limits = task.limits()
    pairs = limits.longest_sequence  # preference pairs: prompt + the longer completion
    if pairs > ctx:
        raise ConfigError(f"a preference pair of {pairs} tokens (prompt + completion) exceeds the model's context "
                          f"(max_position_embeddings={ctx}); bound prompts with data.max_prompt_length, or shorten "
                          "the completions")
    if cfg.env is not None:
        if r.max_episode_tokens > ctx:
            raise ConfigError(f"rollout.max_episode_tokens={r.max_episode_tokens} exceeds the model's context "
                              f"(max_position_embeddings={ctx}); set rollout.max_episode_tokens ≤ {ctx}")
        return
    longest = limits.longest_prompt
    if longest + r.max_new_tokens > ctx:
        raise ConfigError(f"rollout.max_new_tokens={r.max_new_tokens} + the longest prompt ({longest} tokens) = "
                          f"{longest + r.max_new_tokens} exceeds the model's context (max_position_embeddings={ctx}); "
                          f"set rollout.max_new_tokens ≤ {ctx - longest}, or bound prompts with data.max_prompt_length")
