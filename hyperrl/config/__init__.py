"""The run configuration at the edge: schema (:mod:`.schema`), loading and overrides (:mod:`.load`),
every config-shaped check (:mod:`.checks`), resolution against the registries (:mod:`.resolve`)
and the recipe table (:mod:`.recipes`). Everything is checked when a config is loaded, before
any model, engine, process group or ``out_dir`` exists; pure transforms never see these objects.
"""

from hyperrl.config.load import describe, load_config, validate_config
from hyperrl.config.recipes import RECIPES, recipe_config, register_recipe
from hyperrl.config.resolve import registries, resolve
from hyperrl.config.schema import (
    AlgoConfig,
    AsyncConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    KLConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RewardSpec,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    Variant,
    VisionConfig,
)

__all__ = ["load_config", "validate_config", "describe", "TrainConfig", "ConfigError", "Variant", "RewardSpec",
           "DataConfig", "LoraConfig", "ModelConfig", "RolloutConfig", "KLConfig", "CriticConfig", "AlgoConfig",
           "VisionConfig", "OptimConfig", "RunConfig", "AsyncConfig", "RECIPES", "recipe_config", "register_recipe",
           "registries", "resolve"]
