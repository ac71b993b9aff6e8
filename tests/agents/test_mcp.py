"""MCP tools: a real MCP server process over stdio (tests/agents/mcp_server.py, the ``mcp`` SDK)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hyperrl.agents import AgentEnvironment
from hyperrl.agents.mcp import MCPError, MCPTools, Toolbox
from hyperrl.config import ConfigError, load_config
from hyperrl.data.parquet import Sample
from hyperrl.envs import ENVIRONMENTS, Limits, ToolChatEnv, run_episodes
from hyperrl.rollout import SamplingParams, TransformersEngine
from tests.agents.scripted import ScriptedLM, hermes_script
from tests.hf_fixtures import bpe_tokenizer

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_server.py"))]
TOK = bpe_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'


@pytest.fixture(scope="module")
def server():
    tools = MCPTools(SERVER, timeout_s=6.0)  # a restart under a loaded machine (2 test workers) fits in it
    yield tools
    tools.close()


def test_the_servers_tools_with_their_schemas(server):
    assert set(server.tools) == {"calculator", "crash", "slow", "pid"}
    calc = server.tools["calculator"]
    assert calc.schema["properties"]["expression"]["type"] == "string" and calc.schema["required"] == ["expression"]
    assert calc.spec()["function"]["description"].startswith("Evaluate an arithmetic expression")
    assert calc.fn(expression="7 * 8") == "56"


def test_errors_timeouts_and_a_crash_are_tool_errors_and_the_server_comes_back(server):
    """Through the :class:`ToolRunner` an environment uses: a tool the server fails, a timeout and a
    server that dies mid-call are observations; the next call starts the server again."""
    from hyperrl.envs import ToolRunner

    runner = ToolRunner(dict(server.tools), fmt="hyperrl")

    def run(name, args):
        return runner.run(f'<tool>{{"name": "{name}", "arguments": {args}}}</tool>')[0]

    before = run("pid", "{}").text
    bad = run("calculator", '{"expression": "7 *"}')
    assert not bad.ok and "calculator failed" in bad.text
    slow = run("slow", '{"seconds": 10}')
    assert not slow.ok and "timed out after 6.0s" in slow.text
    crashed = run("crash", "{}")
    assert not crashed.ok and "the MCP server failed during the call" in crashed.text
    assert run("calculator", '{"expression": "6 * 9"}').text == "54"
    assert server.restarts == 1 and run("pid", "{}").text != before


def test_a_server_that_does_not_start_is_named():
    with pytest.raises(MCPError, match=r"print\('not mcp'\).*did not start"):
        MCPTools([sys.executable, "-c", "print('not mcp')"], start_timeout_s=10)
    with pytest.raises(MCPError, match="no-such-server-binary.*did not start"):
        MCPTools(["no-such-server-binary"], start_timeout_s=10)


def test_a_silent_server_is_killed_and_a_dying_one_is_named_with_its_stderr(tmp_path):
    """A server that never answers ``initialize`` is killed at the start timeout — it no longer holds the
    trainer's stderr (``hyperrl train … | tee log`` returns); one that exits at once is named with its stderr."""
    import os
    import subprocess
    import time

    from tests.agents.test_programs import processes_with

    marker = f"silent-mcp-{os.getpid()}-{time.time_ns()}"
    script = tmp_path / "host.py"  # a parent whose stderr is a pipe: it ends only when every holder lets go
    script.write_text(f"""
import sys
from hyperrl.agents.mcp import MCPError, MCPTools
try:
    MCPTools([sys.executable, "-c", "import time; time.sleep(300)", {marker!r}], start_timeout_s=2)
except MCPError as e:
    print(e)
""")
    t = time.monotonic()
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert time.monotonic() - t < 60 and "no answer to initialize within 2 s; killed" in out.stdout, out
    assert not processes_with(marker)
    with pytest.raises(MCPError, match=r"did not start .*its stderr: .*ImportError: no module named frobnicate"):
        MCPTools([sys.executable, "-c", "import sys; sys.exit('ImportError: no module named frobnicate')"],
                 start_timeout_s=10)


def test_a_toolbox_of_mcp_and_registered_tools():
    with pytest.raises(MCPError, match="'calculator' is already provided"):  # the MCP calculator and ours clash
        Toolbox([{"mcp": SERVER, "timeout_s": 3.0}, {"name": "calculator"}])
    box = Toolbox([{"mcp": SERVER, "timeout_s": 3.0}])
    try:
        assert [s["function"]["name"] for s in box.specs()] == ["calculator", "crash", "slow", "pid"]
        assert box.call("calculator", '{"expression": "2 * 21"}') == "42"
        assert box.call("calculator", "{oops").startswith("error: malformed arguments JSON")
        assert box.call("nope", {}).startswith("error: unknown tool 'nope'")
    finally:
        box.close()


def test_an_environment_calls_the_mcp_tools_and_rewards_judge_the_final_turn():
    """``tool_chat`` with the server's tools: the template lists their schemas, the model's hermes call
    runs on the server, its result is a tool turn (context), the answer after it is the final turn the
    configured rewards score (``final_turn``)."""
    box = Toolbox([{"mcp": SERVER, "timeout_s": 3.0}])
    try:
        engine = TransformersEngine(ScriptedLM(len(TOK), hermes_script(TOK, CALL, TOK.encode("56"))))
        sp = SamplingParams(max_new_tokens=40, eos_id=END, seed=0)
        batch, builders = run_episodes(engine, lambda: ToolChatEnv(box.tools),
                                       [Sample("What is 7 * 8?", "56", "t", {})], TOK, sp, n=1,
                                       limits=Limits(max_turns=3, max_obs_tokens=64, max_episode_tokens=1200),
                                       capabilities=ENVIRONMENTS.factory("tool_chat").capabilities_for())
    finally:
        box.close()
    (b,) = builders
    assert [k for k, _, _ in b.segments] == ["prompt", "action", "observation", "action"]
    obs = b.segments[2]
    assert "<tool_response>\n56\n</tool_response>" in TOK.decode(b.tokens[obs[1]:obs[2]])
    assert '"calculator"' in TOK.decode(b.tokens[:b.segments[0][2]])  # the schema is in the prompt
    assert batch["final_turn"].tolist() == [b.segments[3][1]] and batch["tool_calls"].tolist() == [1]


AGENT = '''
import json
from hyperrl.agents import AgentResult

def solve(sample, client, tools):
    messages = [{"role": "user", "content": sample.prompt}]
    for _ in range(3):
        msg = client.chat.completions.create(model="hyperrl-policy", messages=messages,
                                             tools=tools.specs()).choices[0].message
        if not msg.tool_calls:
            return float(msg.content == sample.answer)
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": tools.call(c.function.name, c.function.arguments)})
    return 0.0
'''


@pytest.mark.parametrize("isolate", [False, True])
def test_an_agent_program_gets_the_mcp_tools(tmp_path, isolate):
    """``solve(sample, client, tools)``: the run's tools (their OpenAI specs, and calls that run on the
    MCP server) — in the trainer's process, or started again in the agent process."""
    (tmp_path / "agent.py").write_text(AGENT)
    sources = [{"mcp": SERVER, "timeout_s": 3.0}]
    box = None if isolate else Toolbox(sources)
    engine = TransformersEngine(ScriptedLM(len(TOK), hermes_script(TOK, CALL, TOK.encode("56"))))
    agent = AgentEnvironment(program=f"{tmp_path}/agent.py:solve", isolate=isolate).bind(
        engine, TOK, SamplingParams(max_new_tokens=40, eos_id=END, seed=1), max_model_len=4096,
        max_episode_tokens=1024, max_concurrent=2, has_rewards=False, toolbox=box, tool_sources=sources)
    try:
        batch = agent.run([Sample("What is 7 * 8?", "56", "t", {})], agent.gateway.sampling, 2)
    finally:
        agent.close()
        if box is not None:
            box.close()
    assert batch["reward"].tolist() == [1.0, 1.0] and batch["tool_calls"].tolist() == [1, 1]


def test_tools_config_errors(tmp_path):
    def load(*extra):
        return load_config(None, [f"--run.out_dir={tmp_path}", *extra])

    with pytest.raises(ConfigError, match=r"tools\[0\].name: unknown tool 'abacus'"):
        load("--tools=[{name: abacus}]")
    with pytest.raises(ConfigError, match="a tools entry is"):
        load("--tools=[{name: calculator, mcp: [x]}]")
    with pytest.raises(ConfigError, match="env.name: environment 'tool_chat' needs tools: .* and rewards:"):
        load("--env=tool_chat", "--tools=[{name: calculator}]")
    (tmp_path / "agent.py").write_text(AGENT)
    with pytest.raises(ConfigError, match="takes tools .* but no tools: are configured"):
        load(f"--env={{name: agent, program: '{tmp_path}/agent.py:solve'}}")
    cfg = load("--env=tool_chat", "--tools=[{mcp: [python, -m, my_server]}]", "--rewards=[{fn: exact_answer}]")
    assert cfg.tools[0].mcp == ["python", "-m", "my_server"] and cfg.tools[0].timeout_s == 30.0
