"""The real coding-agent CLIs as harnesses (``env: {name: agent, harness: codex | claude_code}``), installed by
.ci/run from agents-cli/ (``npm ci``): each runs per episode against its episode's gateway URL — Codex over the
Responses API, Claude Code over the Messages API, both streaming — and what it printed is the decoding of the ids
the gateway recorded. The policy here is scripted (its answer is fixed; the CLIs' own prompts are ~20–40 k tokens
of a 400-id BPE)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hyperrl.agents import AgentEnvironment
from hyperrl.data import Sample
from hyperrl.rollout import SamplingParams, TransformersEngine
from tests.agents.scripted import ScriptedLM
from tests.agents.test_gateway import END, TOK

pytestmark = pytest.mark.xdist_group("agent_clis")  # one worker installs them, once

ANSWER = TOK.encode("Done: 56") + [END]
CLIS = Path(__file__).resolve().parents[2] / "agents-cli"


@pytest.fixture(scope="module", autouse=True)
def clis():
    """The pinned CLIs (agents-cli/package-lock.json), installed with ``npm ci`` when a fresh clone lacks them —
    as .ci/run does; npm missing or failing is the test's failure, named."""
    if not all((CLIS / "node_modules" / ".bin" / c).exists() for c in ("codex", "claude")):
        r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CLIS, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"npm ci --prefix agents-cli failed: {r.stderr[-2000:]}"
JUDGE = '''
import json
def judge(sample, result):
    said = json.loads(result.stdout)["result"] if result.stdout.startswith("{") else result.stdout
    return 1.0 if result.exit_code == 0 and "Done: 56" in said else 0.0
'''


def _answer(ctx: list[int]) -> int:
    gen = TOK.encode("<|im_start|>assistant\n")
    starts = [i + len(gen) for i in range(len(ctx) - len(gen) + 1) if ctx[i:i + len(gen)] == gen]
    emitted = ctx[starts[-1]:] if starts else []
    return ANSWER[len(emitted)] if len(emitted) < len(ANSWER) else END


@pytest.mark.parametrize("harness", ["codex", "claude_code"])
def test_the_real_cli_runs_through_the_gateway_and_its_answer_is_the_sampled_ids(harness, tmp_path):
    (tmp_path / "judge.py").write_text(JUDGE)
    model = ScriptedLM(len(TOK), _answer)
    model.config.max_position_embeddings = 200_000
    agent = AgentEnvironment(harness=harness, reward=f"{tmp_path}/judge.py:judge", timeout_s=120).bind(
        TransformersEngine(model), TOK, SamplingParams(max_new_tokens=40, eos_id=END, seed=1), max_model_len=200_000,
        max_episode_tokens=None, max_concurrent=2, has_rewards=False)
    try:
        batch = agent.run([Sample("What is 7 * 8?", "56", "t:0", {})], agent.gateway.sampling, 2)
    finally:
        agent.close()
    assert agent.stats["agent_failed"] == 0 and agent.stats["agent_server_errors"] == 0, agent.errors
    assert batch["reward"].tolist() == [1.0] * batch.batch_size[0]
    for tokens, action in zip(batch["tokens"], batch["action_mask"]):
        sampled = tokens[action].tolist()
        assert sampled == ANSWER and TOK.decode(sampled[:-1]) == "Done: 56"
    assert agent.stats["agent_rewrites"] == 0 and agent.stats["agent_calls"] >= 2


def test_a_harness_is_checked_at_load_and_a_missing_cli_is_named(monkeypatch, tmp_path):
    from hyperrl.agents.harnesses import find_cli

    with pytest.raises(ValueError, match=r"env.harness='aider': one of \['claude_code', 'codex'\]"):
        AgentEnvironment(harness="aider")
    with pytest.raises(ValueError, match="exactly one"):
        AgentEnvironment(harness="codex", command=["x"])
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HYPERRL_AGENTS_CLI", str(tmp_path))
    monkeypatch.setattr("hyperrl.agents.harnesses.Path.resolve", lambda self: tmp_path / "a" / "b" / "c")
    with pytest.raises(ValueError, match=r"the 'claude' CLI is not installed — `npm ci --prefix agents-cli` "
                                         r"\(the pinned @anthropic-ai/claude-code\)"):
        find_cli("claude", "@anthropic-ai/claude-code")
