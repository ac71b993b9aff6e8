"""The coding-agent CLIs people train, as named harnesses: ``env: {name: agent, harness: codex}`` (or
``claude_code``) starts the real CLI per episode against the episode's gateway URL — the command line, the
environment and the files each CLI needs to talk to a local model offline (what docs/agents.md's compatibility
table lists). A harness is a registered factory (:data:`HARNESSES`) returning a :class:`Harness`: the executable it
runs (found at build: on ``PATH``, in ``$HYPERRL_AGENTS_CLI``, or in the repository's ``agents-cli/`` installed by
``npm ci --prefix agents-cli``; missing, an error naming the npm package) and ``prepare(episode, workdir, prompt,
model)`` → ``(argv, env)``.

* ``codex`` — OpenAI's Codex CLI (``@openai/codex``): ``codex exec`` over the Responses API (server-sent
  events); a ``config.toml`` in the episode's own ``CODEX_HOME`` names the episode's URL as a model provider
  (``wire_api = "responses"``, the key from ``OPENAI_API_KEY``); web search and sub-agents are switched off (the
  gateway serves function tools only); the commands the policy runs go through Codex's own sandbox
  (``--sandbox workspace-write``: bubblewrap, the episode's directory writable, no network).
* ``claude_code`` — Anthropic's Claude Code (``@anthropic-ai/claude-code``): ``claude -p … --output-format
  json`` over the Messages API, ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` the episode's, no other traffic.

Both run in the episode's temporary directory as their home (no user configuration, no login state leaks in).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hyperrl.registry import Registry

__all__ = ["Harness", "HARNESSES", "find_cli"]

HARNESSES: Registry = Registry("agent harness")


@dataclass(frozen=True)
class Harness:
    """A CLI agent: its ``name``, the ``executable`` it runs and ``prepare(episode, workdir, prompt, model)`` →
    ``(argv, extra environment)`` for one episode."""

    name: str
    executable: str
    prepare: Callable[[object, Path, str, str], tuple[list[str], dict[str, str]]]


def find_cli(command: str, package: str) -> str:
    """The path of ``command``: on ``PATH``, in ``$HYPERRL_AGENTS_CLI`` (a directory holding ``node_modules``), or
    in this repository's ``agents-cli/``; else a ``ValueError`` naming the npm package to install."""
    roots = [os.environ.get("HYPERRL_AGENTS_CLI"), str(Path(__file__).resolve().parents[2] / "agents-cli")]
    for root in filter(None, roots):
        p = Path(root) / "node_modules" / ".bin" / command
        if p.exists():
            return str(p)
    found = shutil.which(command)
    if found:
        return found
    raise ValueError(f"env.harness: the {command!r} CLI is not installed — `npm ci --prefix agents-cli` (the pinned "
                     f"{package}), `npm install -g {package}`, or set HYPERRL_AGENTS_CLI to a directory with it in "
                     "node_modules/.bin")


@HARNESSES.register("codex")
def codex() -> Harness:
    """OpenAI's Codex CLI over the Responses API (see the module doc)."""
    exe = find_cli("codex", "@openai/codex")

    def prepare(ep, workdir: Path, prompt: str, model: str):
        home, tmp = workdir / ".codex", workdir / "tmp"
        home.mkdir(exist_ok=True)
        tmp.mkdir(exist_ok=True)
        (home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "hyperrl"\n\n[model_providers.hyperrl]\nname = "hyperrl"\n'
            f'base_url = "{ep.base_url}"\nenv_key = "OPENAI_API_KEY"\nwire_api = "responses"\n')
        argv = [exe, "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "-c", "web_search=disabled",
                "-c", "features.multi_agent=false", prompt]
        # TMPDIR beside CODEX_HOME, not above it: Codex refuses to place its sandbox helper (codex-linux-sandbox,
        # run inside its bubblewrap) under the temporary directory, and every command it runs then fails
        return argv, {"CODEX_HOME": str(home), "HOME": str(workdir), "TMPDIR": str(tmp), "OPENAI_API_KEY": ep.api_key}

    return Harness("codex", exe, prepare)


@HARNESSES.register("claude_code")
def claude_code() -> Harness:
    """Anthropic's Claude Code over the Messages API (see the module doc)."""
    exe = find_cli("claude", "@anthropic-ai/claude-code")

    def prepare(ep, workdir: Path, prompt: str, model: str):
        env = {"HOME": str(workdir), "ANTHROPIC_BASE_URL": ep.base_url.removesuffix("/v1"),
               "ANTHROPIC_API_KEY": ep.api_key, "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        return [exe, "-p", prompt, "--output-format", "json"], env

    return Harness("claude_code", exe, prepare)
