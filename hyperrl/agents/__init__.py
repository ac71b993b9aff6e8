"""Agents that own their loop: an OpenAI-compatible gateway recording exact tokens, agent programs
and CLI agents from config (``env: {name: agent, …}``), MCP tools (docs/agents.md)."""

from hyperrl.agents.gateway import Gateway, GatewayEpisode, GatewayError
from hyperrl.agents.programs import AgentCancelled, AgentEnvironment, AgentError, AgentResult, CommandResult
from hyperrl.agents.record import Chain, EpisodeRecord, normalize_message

__all__ = ["Gateway", "GatewayEpisode", "GatewayError", "AgentEnvironment", "AgentError", "AgentCancelled",
           "AgentResult",
           "CommandResult", "Chain", "EpisodeRecord", "normalize_message"]
