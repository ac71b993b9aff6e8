"""Agent programs and CLI agents from config: real programs with the official ``openai`` client, a real
subprocess reading ``OPENAI_BASE_URL``, behind a real gateway over a real engine."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import pytest

from hyperrl.agents import AgentEnvironment, AgentError
from hyperrl.config import ConfigError, load_config
from hyperrl.data.parquet import Sample
from hyperrl.rollout import SamplingParams, TransformersEngine
from tests.agents.scripted import ScriptedLM, hermes_script
from tests.hf_fixtures import bpe_tokenizer

TOK = bpe_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'
SAMPLES = [Sample("What is 7 * 8?", "56", "t:0", {"level": "easy"}), Sample("What is 6 * 9?", "54", "t:1", {})]

AGENT = '''
import json, os, sys, time
from hyperrl.agents import AgentResult
from hyperrl.envs.tools import calculate

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def _loop(sample, create):
    messages = [{"role": "user", "content": sample.prompt}]
    for _ in range(3):
        msg = create(messages)
        if not msg.tool_calls:
            return AgentResult(reward=float(msg.content == sample.answer), success=msg.content == sample.answer)
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls:
            result = calculate(json.loads(c.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return 0.0


def solve(sample, client):
    return _loop(sample, lambda m: client.chat.completions.create(model="hyperrl-policy", messages=m,
                                                                  tools=TOOLS).choices[0].message)


async def solve_async(sample, client):
    messages = [{"role": "user", "content": sample.prompt}]
    r = await client.chat.completions.create(model="hyperrl-policy", messages=messages, tools=TOOLS)
    return 0.5


def crash(sample, client):
    client.chat.completions.create(model="hyperrl-policy", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent broke on " + sample.source)


def hang(sample, client):
    time.sleep(60)


def silent(sample, client):
    return 1.0


def _ask(sample, client):
    client.chat.completions.create(model="hyperrl-policy", messages=[{"role": "user", "content": sample.prompt}])


def die_on_t1(sample, client):  # t:1's episodes take the agent process down once the others have returned;
    _ask(sample, client)        # with DIE_ONCE set (a file), only the first time
    once = os.environ.get("DIE_ONCE")
    if sample.source == "t:1" and not (once and os.path.exists(once)):
        time.sleep(1.5)
        if once:
            open(once, "w").close()
        os._exit(3)
    return 1.0


SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def leave_daemons(sample, client):  # a child in its own session and a double-forked one, both outliving solve()
    import subprocess
    _ask(sample, client)
    marker = os.environ["DAEMON_MARKER"]
    subprocess.Popen([*SLEEPER, marker], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [*SLEEPER, marker])
        os._exit(0)
    if os.environ.get("THEN_HANG"):
        time.sleep(120)
    return 1.0


def die(sample, client):
    os._exit(3)


def none(sample, client):
    client.chat.completions.create(model="hyperrl-policy", messages=[{"role": "user", "content": "hi"}])
'''

CLI = '''
import os, subprocess, sys, time
from openai import OpenAI  # reads OPENAI_BASE_URL and OPENAI_API_KEY

task = sys.argv[sys.argv.index("--task") + 1]
marker = sys.argv[sys.argv.index("--marker") + 1] if "--marker" in sys.argv else "none"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)", marker]  # found by its marker in /proc
if "--hang" in sys.argv:
    child = subprocess.Popen(SLEEPER)
    time.sleep(120)
if "--escape" in sys.argv:  # a daemon in its own session, holding this agent's stdout and stderr
    subprocess.Popen(SLEEPER, start_new_session=True)
if "--double-fork" in sys.argv:  # the classic daemon: fork, setsid, fork; the grandchild is nobody's child
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, SLEEPER)
        os._exit(0)
client = OpenAI(max_retries=0)
r = client.chat.completions.create(model="hyperrl-policy", messages=[{"role": "user", "content": task}])
print("the model said:", r.choices[0].message.content)
if "--verbose" in sys.argv:  # 8 MiB to each stream, then the last line the judge needs
    block = "x" * 1023 + "\\n"
    for _ in range(8192):
        sys.stdout.write(block)
        sys.stderr.write(block)
    print("the model said:", r.choices[0].message.content)
if "--then-hang" in sys.argv:
    time.sleep(120)
open(os.environ["HYPERRL_RESULT_FILE"], "w").write("done " + task)
if "--fail" in sys.argv:
    print("something went wrong", file=sys.stderr)
    sys.exit(2)
'''

JUDGE = '''
def judge(sample, result):
    assert result.exit_code == 0 and result.stdout.startswith("the model said:"), (result.exit_code,
                                                                                   result.stderr[-500:])
    return 1.0 if result.result == "done " + sample.prompt else 0.0
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents")
    (d / "agent.py").write_text(AGENT)
    (d / "cli.py").write_text(CLI)
    (d / "judge.py").write_text(JUDGE)
    return d


def _agent(has_rewards=False, **kw) -> AgentEnvironment:
    engine = TransformersEngine(ScriptedLM(len(TOK), hermes_script(TOK, CALL, TOK.encode("56"))))
    sp = SamplingParams(max_new_tokens=40, eos_id=END, seed=1)
    return AgentEnvironment(**kw).bind(engine, TOK, sp, max_model_len=4096, max_episode_tokens=1024,
                                       max_concurrent=4, has_rewards=has_rewards)


@pytest.mark.parametrize("isolate,workers", [(False, 1), (True, 1), (True, 2)])
def test_a_program_with_the_openai_client_trains_on_its_episodes(files, isolate, workers):
    """``solve(sample, client)``: a tool loop through the official client; each episode is one row
    (prompt, the sampled call, the tool turn as context, the sampled answer), its reward and success
    the program's, its group id its prompt's — in this process, in an agent process, or split over two."""
    agent = _agent(program=f"{files}/agent.py:solve", isolate=isolate, workers=workers)
    pool = agent.worker
    try:
        batch = agent.run(SAMPLES, agent.gateway.sampling, 2, group_offset=10)
        if workers > 1:  # both processes ran a slice of the round (each started on its first slice)
            pids = {w._proc.pid for w in agent.worker.workers if w._proc is not None and w._proc.is_alive()}
            assert len(pids) == workers
    finally:
        agent.close()
    if isolate:  # a round arriving after close (an asynchronous run's last unit) fails; no process is started again
        late = pool.run([(SAMPLES[0], "http://127.0.0.1:9/v1", "k")] * 3)
        assert [o.error for o in late] == ["the agent processes were closed (the run is ending)"] * 3
        assert not [p for p in multiprocessing.active_children() if p.name == "hyperrl-agent"]
    assert batch["group_id"].tolist() == [10, 10, 11, 11]
    assert batch["reward"].tolist() == [1.0, 1.0, 0.0, 0.0]  # the scripted model answers 56 to both
    assert batch["success"].tolist() == [1.0, 1.0, 0.0, 0.0] and batch["tool_calls"].tolist() == [1] * 4
    assert agent.stats["agent_calls"] == 8 and agent.stats["agent_failed"] == 0
    sampled = len(TOK.encode(CALL)) + 1 + len(TOK.encode("56")) + 1
    assert batch["action_mask"].sum(-1).tolist() == [sampled] * 4
    assert batch["finish_reason"].tolist() == [0] * 4  # the last turn ended with <|im_end|>: stop


def test_an_async_program_gets_an_async_client(files):
    agent = _agent(program=f"{files}/agent.py:solve_async", isolate=False)
    try:
        batch = agent.run(SAMPLES, agent.gateway.sampling, 3)
    finally:
        agent.close()
    assert batch["reward"].tolist() == [0.5] * 6 and "success" not in batch.keys()


@pytest.mark.parametrize("isolate", [False, True])
def test_failing_agents_fail_their_episodes_never_the_step(files, isolate, capfd):
    """A program that raises fails its episodes with its traceback's tail (counted, said once); one
    that never calls the model has nothing to train on (counted); one that returns None without
    configured rewards is an error naming the fix; when nothing is left the round says why."""
    for name, stat, words in [("crash", "agent_failed", "the agent broke on t:0"), ("silent", "agent_empty", None),
                              ("none", "agent_failed", "no rewards: are configured")]:
        agent = _agent(program=f"{files}/agent.py:{name}", isolate=isolate)
        try:
            with pytest.raises(AgentError, match="no agent episode produced a row"):
                agent.run(SAMPLES, agent.gateway.sampling, 1)
        finally:
            agent.close()
        assert agent.stats[stat] == 2, name
        if words:
            assert words in agent.errors[0] and words in capfd.readouterr().err


def test_a_hung_program_times_out_and_a_dead_agent_process_is_restarted(files):
    agent = _agent(program=f"{files}/agent.py:hang", isolate=False, timeout_s=0.5)
    t = time.monotonic()
    try:
        with pytest.raises(AgentError):
            agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    assert time.monotonic() - t < 10 and "timed out after 0.5s" in agent.errors[0]
    agent = _agent(program=f"{files}/agent.py:die", isolate=True)
    try:
        for _ in range(2):  # the process dies every round, and again on the retry; the next round restarts it
            with pytest.raises(AgentError, match=r"died \(exit code 3\) \(retried once\)"):
                agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
            assert agent.stats["agent_retried_episodes"] == 1
        assert agent.worker.restarts == 3
    finally:
        agent.close()


@pytest.mark.parametrize("once", [True, False])
def test_one_crashing_episode_fails_only_itself(files, tmp_path, monkeypatch, once):
    """t:1's episodes ``os._exit`` the shared agent process after t:0's have returned: t:0's outcomes are kept,
    t:1's — lost with the process — run again once in a fresh process and a fresh gateway episode (counted).
    Dying only the first time, they then succeed; dying again, only they fail."""
    if once:
        monkeypatch.setenv("DIE_ONCE", str(tmp_path / "died"))
    agent = _agent(program=f"{files}/agent.py:die_on_t1", isolate=True, has_rewards=False)
    try:
        batch = agent.run(SAMPLES, agent.gateway.sampling, 2)
    finally:
        agent.close()
    assert agent.stats["agent_retried_episodes"] == 2 and agent.stats["agent_episodes"] == 4
    assert agent.stats["agent_failed"] == (0 if once else 2), agent.errors
    assert batch["group_id"].tolist() == ([0, 0, 1, 1] if once else [0, 0])
    assert batch["reward"].tolist() == [1.0] * (4 if once else 2)
    assert agent.stats["agent_rewrites"] == 0 and agent.stats["agent_rows"] == (4 if once else 2)
    if not once:
        assert all("died (exit code 3) (retried once)" in e for e in agent.errors)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(marker: str, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_what_an_agent_program_starts_ends_with_its_round(files, monkeypatch):
    """A program that leaves daemons behind (its own session; a double fork): the agent process adopts them (a
    child subreaper) and ends them when no round is running."""
    marker = f"program-daemon-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("DAEMON_MARKER", marker)
    agent = _agent(program=f"{files}/agent.py:leave_daemons", isolate=True)
    try:
        batch = agent.run(SAMPLES, agent.gateway.sampling, 1)
        assert batch["reward"].tolist() == [1.0, 1.0]
        assert _gone(marker), "a daemon an agent program started outlived its round"
    finally:
        agent.close()


def test_agent_processes_die_with_the_trainer(files, tmp_path):
    """``kill -9`` of the trainer mid-round: its agent process notices (its parent is gone) and ends itself and
    every daemon its agents started, within seconds."""
    marker = f"orphan-{os.getpid()}-{time.time_ns()}"
    pids = tmp_path / "pids"
    script = tmp_path / "trainer.py"
    script.write_text(f'''
import os, sys, threading, time
sys.path.insert(0, {os.getcwd()!r})
from tests.agents.test_programs import SAMPLES, _agent
if __name__ == "__main__":  # the agent process is spawned: it imports this file
    agent = _agent(program={f"{files}/agent.py:leave_daemons"!r}, isolate=True)
    threading.Thread(target=agent.run, args=(SAMPLES, agent.gateway.sampling, 1), daemon=True).start()
    while not (agent.worker.workers[0]._proc and agent.worker.workers[0]._proc.pid):
        time.sleep(0.1)
    open({str(pids)!r}, "w").write(str(agent.worker.workers[0]._proc.pid))
    time.sleep(120)
''')
    import subprocess

    trainer = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "DAEMON_MARKER": marker,
                                                                    "THEN_HANG": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (pids.exists() and processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with(marker), "the agents never started their daemons"
        worker = int(pids.read_text())
    finally:
        trainer.kill()
        trainer.wait()
    assert _gone(marker, 10), "daemons outlived the killed trainer"
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the agent process outlived the killed trainer"


def test_a_cli_agent_reads_openai_base_url_and_is_judged(files):
    """A subprocess (no shell) with ``{prompt}`` in its argv and ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``
    in its environment; its stdout, exit code and result file go to ``env.reward``."""
    agent = _agent(command=[sys.executable, f"{files}/cli.py", "--task", "{prompt}"], reward=f"{files}/judge.py:judge")
    try:
        batch = agent.run(SAMPLES, agent.gateway.sampling, 2)
    finally:
        agent.close()
    assert batch["reward"].tolist() == [1.0] * 4 and agent.stats["agent_calls"] == 4


def test_a_cli_agent_that_fails_or_hangs_is_reported_and_its_process_group_killed(files, tmp_path):
    agent = _agent(command=[sys.executable, f"{files}/cli.py", "--task", "{prompt}", "--fail"], has_rewards=True)
    try:
        with pytest.raises(AgentError, match=r"exit code 2; stderr: something went wrong"):
            agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    marker = f"hang-{os.getpid()}-{time.time_ns()}"
    agent = _agent(command=[sys.executable, f"{files}/cli.py", "--task", "{prompt}", "--hang", "--marker", marker],
                   has_rewards=True, timeout_s=2.0)
    try:
        with pytest.raises(AgentError, match=r"timed out after 2.0s"):
            agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    assert not processes_with(marker), "the agent's child outlived the timeout"


def processes_with(marker: str) -> list[int]:
    """The pids of live processes (zombies aside) whose command line holds ``marker``."""
    found = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if marker.encode() in cmd and state != "Z":
            found.append(int(d))
    return found


@pytest.mark.parametrize("escape", ["--escape", "--double-fork"])
def test_a_cli_agents_escaped_descendants_end_with_its_episode(files, escape):
    """A CLI agent that leaves a daemon behind in another session (``setsid``; a double fork), holding its stdout
    and stderr, then exits 0: the episode ends when the agent does — judged, not timed out — and the daemon is
    gone with it (the agent's pid namespace: hyperrl.sandbox.tree)."""
    marker = f"escape-{os.getpid()}-{time.time_ns()}"
    agent = _agent(command=[sys.executable, f"{files}/cli.py", "--task", "{prompt}", escape, "--marker", marker],
                   reward=f"{files}/judge.py:judge", timeout_s=60)
    t = time.monotonic()
    try:
        batch = agent.run(SAMPLES[:2], agent.gateway.sampling, 1)
    finally:
        agent.close()
    assert time.monotonic() - t < 30 and agent.stats["agent_failed"] == 0, agent.errors
    assert batch["reward"].tolist() == [1.0, 1.0]
    assert not processes_with(marker), "an escaped daemon outlived its episode"


def test_an_escaped_daemon_cannot_hold_a_timed_out_episode(files):
    """The agent leaves a daemon in its own session and then hangs: at ``timeout_s`` the episode fails, in about
    that time — the daemon's open pipes do not stall the round — and the daemon is gone."""
    marker = f"escape-hang-{os.getpid()}-{time.time_ns()}"
    agent = _agent(command=[sys.executable, f"{files}/cli.py", "--task", "{prompt}", "--escape", "--then-hang",
                            "--marker", marker], has_rewards=True, timeout_s=3.0)
    t = time.monotonic()
    try:
        with pytest.raises(AgentError, match=r"timed out after 3.0s"):
            agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    assert time.monotonic() - t < 15
    assert not processes_with(marker)


def test_a_verbose_agents_output_is_kept_to_a_bounded_tail(files, tmp_path):
    """8 MiB on each stream: the judge gets the last MiB of each (its last line intact) and ``truncated``."""
    seen = tmp_path / "seen.txt"
    (tmp_path / "judge.py").write_text(f'''
def judge(sample, result):
    open({str(seen)!r}, "w").write(f"{{len(result.stdout)}} {{len(result.stderr)}} {{result.truncated}}")
    return 1.0 if result.stdout.rstrip().splitlines()[-1].startswith("the model said:") else 0.0
''')
    agent = _agent(command=[sys.executable, f"{files}/cli.py", "--task", "{prompt}", "--verbose"],
                   reward=f"{tmp_path}/judge.py:judge", timeout_s=60)
    try:
        batch = agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    out, err, truncated = seen.read_text().split()
    assert int(out) <= 1 << 20 and int(err) <= 1 << 20 and int(err) > (1 << 20) - 1024 and truncated == "True"
    assert batch["reward"].tolist() == [1.0]


def test_agent_config_errors_at_load(files, tmp_path):
    def load(env, *extra):
        return load_config(None, [f"--run.out_dir={tmp_path}", f"--env={env}", *extra])

    with pytest.raises(ConfigError, match="env.program: environment 'agent' needs env.program .* exactly one"):
        load("{name: agent}")
    with pytest.raises(ConfigError, match="nope.py does not exist"):
        load("{name: agent, program: nope.py:solve}")
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        load(f"{{name: agent, program: '{files}/agent.py:missing'}}")
    with pytest.raises(ConfigError, match="needs env.reward"):
        load("{name: agent, command: [python, x.py]}")
    with pytest.raises(ConfigError, match="tool_format"):
        load(f"{{name: agent, program: '{files}/agent.py:solve', tool_format: xml}}")
    with pytest.raises(ConfigError, match=r"env.workers=0: the number of agent processes"):
        load(f"{{name: agent, program: '{files}/agent.py:solve', workers: 0}}")
    with pytest.raises(ConfigError, match=r"env.workers=2: agent processes run a program"):
        load("{name: agent, command: [python, x.py], reward: x.py:f, workers: 2}")
    cfg = load(f"{{name: agent, program: '{files}/agent.py:solve'}}")
    assert cfg.env.args["tool_format"] == "hermes" and cfg.rollout.max_concurrent_episodes == 64


def test_the_prompt_placeholders_are_formatted_without_a_shell(files, tmp_path):
    out = tmp_path / "argv.txt"
    script = tmp_path / "argv.py"
    script.write_text("import sys, json; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n')")
    agent = _agent(command=[sys.executable, str(script), str(out), "{prompt}", "{extra[level]}", "$HOME; rm -rf /"],
                   reward=f"{files}/judge.py:judge")
    try:
        with pytest.raises(AgentError):  # it never calls the model: nothing to train on
            agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    assert out.read_text().strip() == '["What is 7 * 8?", "easy", "$HOME; rm -rf /"]'


RETRY = '''
def solve(sample, client):
    import openai
    for attempt in range(2):  # a server error (500) is retried once, as an agent with retries would
        try:
            client.chat.completions.create(model="hyperrl-policy", messages=[{"role": "user", "content": "hi"}])
            return 1.0
        except openai.InternalServerError:
            continue
    return 0.0
'''


def test_a_gateway_error_the_agent_survived_is_counted_and_said(files, capfd):
    (files / "retry.py").write_text(RETRY)
    agent = _agent(program=f"{files}/retry.py:solve", isolate=False)
    gen, calls = agent.gateway.engine.generate_requests, []

    def once_broken(*a, **kw):  # the engine's first call fails: its episodes' calls get a 500
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine hiccup")
        return gen(*a, **kw)

    agent.gateway.engine.generate_requests = once_broken
    try:
        batch = agent.run(SAMPLES[:1], agent.gateway.sampling, 1)
    finally:
        agent.close()
    assert batch["reward"].tolist() == [1.0] and agent.stats["agent_failed"] == 0
    assert agent.stats["agent_server_errors"] == 1
    assert "1 gateway calls of this round failed on the server; the first: RuntimeError: engine hiccup" in \
        capfd.readouterr().err
