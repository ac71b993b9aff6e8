"""Environments, agent programs, tools and rewards (see :mod:`.base`)."""

from hyperrl.envs.base import (
    ENVIRONMENTS,
    AgentProgram,
    EnvCapabilities,
    Environment,
    Episode,
    EpisodeBuilder,
    Limits,
    StepResult,
    episodes_batch,
    register_environment,
    run_episodes,
    stack_episodes,
)
from hyperrl.envs.examples import CalculatorCopyEnv, GSM8KCalculatorEnv, SearchEnv, ToolChatEnv
from hyperrl.envs.tools import (
    TOOLS,
    BM25Index,
    Tool,
    ToolResult,
    ToolRunner,
    calculate,
    make_search_tool,
    register_tool,
    resolve_call,
)

__all__ = [
    "Environment", "EnvCapabilities", "StepResult", "ENVIRONMENTS", "register_environment", "AgentProgram",
    "EpisodeBuilder", "Limits",
    "Episode", "episodes_batch", "run_episodes", "stack_episodes",
    "CalculatorCopyEnv", "GSM8KCalculatorEnv", "SearchEnv", "ToolChatEnv",
    "TOOLS", "Tool", "ToolResult", "ToolRunner",
    "register_tool", "calculate", "BM25Index", "make_search_tool", "resolve_call",
]
