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


GEN = TOK.encode("<|im_start|>assistant\n")


def _has(ctx: list[int], pattern: list[int]) -> bool:
    return any(ctx[i:i + len(pattern)] == pattern for i in range(len(ctx) - len(pattern) + 1))


def _say(target: list[int], ctx: list[int]) -> int:
    """The next id of ``target`` in the current assistant turn (then the end)."""
    starts = [i + len(GEN) for i in range(len(ctx) - len(GEN) + 1) if ctx[i:i + len(GEN)] == GEN]
    emitted = ctx[starts[-1]:] if starts else []
    return target[len(emitted)] if len(emitted) < len(target) else END


def _answer(ctx: list[int]) -> int:
    return _say(ANSWER, ctx)


def _run(harness: str, policy, tmp_path, episodes: int = 1, max_new_tokens: int = 40):
    """``episodes`` episodes of the CLI against a scripted ``policy(context ids) → next id``; → (batch, stats)."""
    (tmp_path / "judge.py").write_text(JUDGE)
    model = ScriptedLM(len(TOK), policy)
    model.config.max_position_embeddings = 200_000
    agent = AgentEnvironment(harness=harness, reward=f"{tmp_path}/judge.py:judge", timeout_s=120).bind(
        TransformersEngine(model), TOK, SamplingParams(max_new_tokens=max_new_tokens, eos_id=END, seed=1),
        max_model_len=200_000, max_episode_tokens=None, max_concurrent=2, has_rewards=False)
    try:
        batch = agent.run([Sample("What is 7 * 8?", "56", "t:0", {})], agent.gateway.sampling, episodes)
    finally:
        agent.close()
    assert agent.stats["agent_failed"] == 0 and agent.stats["agent_server_errors"] == 0, agent.errors
    assert agent.stats["agent_refused_requests"] == 0
    return batch, agent.stats


@pytest.mark.parametrize("harness", ["codex", "claude_code"])
def test_the_real_cli_runs_through_the_gateway_and_its_answer_is_the_sampled_ids(harness, tmp_path):
    batch, stats = _run(harness, _answer, tmp_path, episodes=2)
    assert batch["reward"].tolist() == [1.0] * batch.batch_size[0]
    for tokens, action in zip(batch["tokens"], batch["action_mask"]):
        sampled = tokens[action].tolist()
        assert sampled == ANSWER and TOK.decode(sampled[:-1]) == "Done: 56"
    assert stats["agent_rewrites"] == 0 and stats["agent_calls"] >= 2


# each CLI's own shell tool, called in the model's (Hermes) format: the CLI runs it — Codex inside its bubblewrap
# sandbox, the episode's directory writable — and sends the output back as a function_call_output / tool_result
CALLS = {"codex": '{"name": "exec_command", "arguments": {"cmd": "echo $((7*8)) > a.txt; cat a.txt"}}',
         "claude_code": '{"name": "Bash", "arguments": {"command": "echo $((7*8))", "description": "multiply"}}'}


@pytest.mark.parametrize("harness", ["codex", "claude_code"])
def test_the_real_cli_runs_the_policys_tool_call_and_the_result_is_an_observation(harness, tmp_path):
    """The policy calls the CLI's shell tool; the CLI runs it and asks again with the result: the second call
    extends the first (one row: call, the tool result as masked observation, the answer), nothing rewritten."""
    call = TOK.encode(f"<tool_call>{CALLS[harness]}</tool_call>") + [END]
    response = TOK.encode("<tool_response>")
    batch, stats = _run(harness, lambda ctx: _say(ANSWER if _has(ctx, response) else call, ctx), tmp_path,
                        max_new_tokens=120)
    assert stats["agent_calls"] == 2 and stats["agent_rows"] == 1 and stats["agent_rewrites"] == 0
    assert stats["agent_malformed_tool_calls"] == 0 and batch["reward"].tolist() == [1.0]
    tokens, action, attn = batch["tokens"][0], batch["action_mask"][0], batch["attention_mask"][0]
    assert tokens[action].tolist() == call + ANSWER
    first = int(action.int().argmax())
    observation = TOK.decode(tokens[first:][(attn & ~action)[first:]].tolist())
    assert "<tool_response>" in observation and "\n56\n" in observation, observation
    assert int(batch["tool_calls"][0]) == 1


def test_claude_codes_own_context_rewrite_starts_a_counted_row(tmp_path):
    """Claude Code answers an empty turn by rewriting its last user message (a note appended: "[Your previous
    response had no visible output. …]") and asking again — a real CLI's context rewrite: the second call cannot
    extend the first row (its history changed), so it is a row of its own, counted in ``agent_rewrites``, and both
    rows are token-exact."""
    note = TOK.encode("no visible output")
    batch, stats = _run("claude_code", lambda ctx: _answer(ctx) if _has(ctx, note) else END, tmp_path)
    assert stats["agent_calls"] == 2 and stats["agent_rewrites"] == 1 and stats["agent_rows"] == 2
    assert batch["reward"].tolist() == [1.0, 1.0]
    sampled = [t[a].tolist() for t, a in zip(batch["tokens"], batch["action_mask"])]
    assert sampled == [[END], ANSWER]
    first, second = (TOK.decode(t[m].tolist()) for t, m in zip(batch["tokens"], batch["attention_mask"]))
    assert "no visible output" not in first and "no visible output" in second


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



def test_a_cli_whose_prompt_does_not_fit_is_named_with_the_refusal(tmp_path):
    """Codex's ~22 k-token prompt against a 1,000-token context: every request is refused (400), counted, and the
    round's error names the refusal — not "never called the model"."""
    from hyperrl.agents import AgentError

    (tmp_path / "judge.py").write_text(JUDGE)
    agent = AgentEnvironment(harness="codex", reward=f"{tmp_path}/judge.py:judge", timeout_s=60).bind(
        TransformersEngine(ScriptedLM(len(TOK), _answer)), TOK, SamplingParams(max_new_tokens=40, eos_id=END, seed=1),
        max_model_len=1000, max_episode_tokens=None, max_concurrent=1, has_rewards=False)
    try:
        with pytest.raises(AgentError, match=r"1 sampled nothing; the gateway refused [1-9]\d* requests, the first: "
                                             r"POST /episodes/\w+/v1/responses: 400 .*leaves no room in the context "
                                             r"\(1000 tokens\)"):
            agent.run([Sample("What is 7 * 8?", "56", "t:0", {})], agent.gateway.sampling, 1)
        assert agent.stats["agent_refused_requests"] >= 1
    finally:
        agent.close()
