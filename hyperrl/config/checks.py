"""Every config-shaped check, run at load time (:func:`hyperrl.config.load_config`) — before any
model, engine, process group or ``out_dir`` exists. Each raises :class:`ConfigError` naming the
dotted key and the fix."""

from __future__ import annotations

from pathlib import Path

from hyperrl.config.schema import ConfigError, TrainConfig

__all__ = ["check_config"]


def _check_parallel(cfg: TrainConfig) -> None:
    """Tensor parallelism: what it combines with, and the engine's TP degree (1 or the trainer's)."""
    import os

    tp, eng = cfg.run.tp, cfg.rollout.engine
    etp = int(eng.args.get("tp", 1)) if eng.name == "transformers" else 1
    if etp != tp:  # the TP engine broadcasts its group's sampled tokens: the ranks of a TP group train on one batch
        raise ConfigError(f"rollout.engine={eng.name} with tp={etp}: run.tp={tp} needs the engine split the same "
                          f"way — rollout.engine={{name: transformers, tp: {tp}}} — so that the ranks of a TP group "
                          f"generate one batch together (separate engines may sample different rows)")
    if tp == 1:
        return
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp or world == 1:
        raise ConfigError(f"run.tp={tp}: needs torchrun with a multiple of {tp} processes (WORLD_SIZE={world})")
    for bad, why in ((cfg.model.lora is not None, "model.lora (the adapters' base is replicated, not split)"),
                     (bool(cfg.model.compile), "model.compile")):
        if bad:
            raise ConfigError(f"run.tp={tp} with {why} is not supported; set run.tp=1")


def _check_rewards(cfg: TrainConfig) -> None:
    """Every reward resolves (:func:`hyperrl.rewards.check_rewards`) — without building a reward model."""
    from hyperrl.registry import HyperparameterError
    from hyperrl.rewards import RewardError, check_rewards

    try:
        check_rewards(cfg.rewards)
    except (RewardError, HyperparameterError) as e:
        raise ConfigError(str(e)) from None


def _check_files(cfg: TrainConfig) -> None:
    """Directories the config names exist and hold what is read from them (before anything is built)."""
    m = cfg.model
    if m.checkpoint is not None:
        ck = Path(m.checkpoint)
        if not (ck / "config.json").is_file():
            raise ConfigError(f"model.checkpoint: {ck} is not a Hugging Face model directory (no config.json); "
                              "save one with model.save_pretrained(dir)")
    from hyperrl.tokenizer import TOKENIZER_FILES

    tok = m.tokenizer or m.checkpoint
    if tok is not None and not any((Path(tok) / f).is_file() for f in TOKENIZER_FILES):
        key = "model.tokenizer" if m.tokenizer else "model.checkpoint"
        raise ConfigError(f"{key}: {tok} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save it with "
                          "tokenizer.save_pretrained(dir) or point model.tokenizer at the tokenizer's directory")


def check_config(cfg: TrainConfig) -> None:
    """Every config-shaped check of a validated config (files, rewards, parallelism, the loop's
    combinations); raises :class:`ConfigError` naming the key and the fix."""
    _check_files(cfg)
    _check_rewards(cfg)
    _check_parallel(cfg)
