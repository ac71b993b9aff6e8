import time
from pathlib import Path

import pytest
import torch

from hyperrl.data import PromptDataset, Sample
from hyperrl.envs import (
    ENVIRONMENTS,
    BM25Index,
    EpisodeBuilder,
    GSM8KCalculatorEnv,
    Limits,
    SearchEnv,
    StepResult,
    Tool,
    ToolRunner,
    calculate,
    make_search_tool,
    run_episodes,
    stack_episodes,
)
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rewards import extract_gsm8k_answer, gsm8k_exact
from hyperrl.rollout import SamplingParams, TransformersEngine
from hyperrl.tokenizer import char_tokenizer
from hyperrl.transforms import sequence_logprobs

DATA = Path(__file__).parents[1] / "data"
TOK = char_tokenizer()


def test_gsm8k_extraction():
    assert extract_gsm8k_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_gsm8k_answer("#### $1,000") == "1000"
    assert extract_gsm8k_answer("it is 12 then 15.50") == "15.5"
    assert extract_gsm8k_answer("no numbers") is None
    s = Sample("q", "1,000", "x:0", {})
    assert gsm8k_exact("the answer is #### 1000", s) == 1.0 and gsm8k_exact("#### 999", s) == 0.0


def test_calculator_is_safe():
    assert calculate("2 + 3 * (4 - 1)") == "11"
    assert calculate("7 / 2") == "3.5" and calculate("2 ** 10") == "1024"
    for bad in ("__import__('os')", "a + 1", "(1).real", "2 ** 1000", "[1, 2]"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)


def test_tool_runner_errors_become_observations():
    slow = Tool("slow", lambda: time.sleep(2) or "late", {"type": "object"}, timeout=0.2)
    boom = Tool("boom", lambda: 1 / 0, {"type": "object"})
    runner = ToolRunner({"calculator": __import__("hyperrl.envs.tools", fromlist=["x"]).calculator_tool,
                         "slow": slow, "boom": boom}, max_calls_per_turn=5)
    text = ('<tool>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool>'
            '<tool>{"name": "calculator", "arguments": {"expr": "1"}}</tool>'
            '<tool>{not json}</tool><tool>{"name": "nope"}</tool>'
            '<tool>{"name": "slow", "arguments": {}}</tool><tool>{"name": "boom", "arguments": {}}</tool>')
    t0 = time.perf_counter()
    res = runner.run(text)
    assert time.perf_counter() - t0 < 1.5  # the timeout, not the tool, bounds the turn
    assert res[0].ok and res[0].text == "42"
    assert not res[1].ok and "invalid arguments" in res[1].text
    assert not res[2].ok and "malformed" in res[2].text
    assert not res[3].ok and "unknown tool 'nope'" in res[3].text
    assert "more than 5 tool calls" in res[5].text
    res = ToolRunner({"slow": slow, "boom": boom}).run(
        '<tool>{"name": "slow", "arguments": {}}</tool><tool>{"name": "boom", "arguments": {}}</tool>')
    assert "timed out" in res[0].text and "ZeroDivisionError" in res[1].text


def test_bm25_search_ranks_relevant_doc():
    idx = BM25Index.from_jsonl(DATA / "corpus.jsonl")
    assert idx.search("capital of France")[0][1]["id"] == 0
    assert "Berlin" in make_search_tool(idx).fn(query="Germany capital")
    assert idx.search("zzz") == []


class EchoEnv:
    """Observation after each action, done after 3 turns; reward 1 on the last step."""

    def reset(self, sample):
        self.turn = 0
        return sample.prompt

    def step(self, action):
        self.turn += 1
        return StepResult(f"<obs{self.turn}>", float(self.turn == 3), self.turn == 3)


def test_multi_turn_masks_token_by_token():
    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=4))
    samples = [Sample("12+30=", "42", "x:0", {}), Sample("5*5=", "25", "x:1", {})]
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    batch, builders = run_episodes(eng, EchoEnv, samples, TOK, sp, n=2, limits=Limits(max_turns=3, max_obs_tokens=4))
    assert batch["group_id"].tolist() == [0, 0, 1, 1] and batch["reward"].tolist() == [1.0] * 4
    assert "success" not in batch.keys()  # EchoEnv gives no verdict (no reports_success)
    for row, b in enumerate(builders):
        kinds = [k for k, _, _ in b.segments]
        assert kinds == ["prompt", "action", "observation", "action", "observation", "action"]
        for kind, s, e in b.segments:
            assert batch["action_mask"][row, s:e].all() == (kind == "action")
            assert (batch["action_mask"][row, s:e] == (kind == "action")).all()
            if kind == "observation":  # encoded once, truncated to max_obs_tokens, log-prob 0
                turn = b.segments.index((kind, s, e)) // 2
                assert batch["tokens"][row, s:e].tolist() == TOK.encode(f"<obs{turn}>", add_special_tokens=False)[:4]
                assert (batch["rollout_logprobs"][row, s:e] == 0).all()
        assert not batch["action_mask"][row, len(b.tokens):].any()
    # the whole multi-turn context scores the same under a fresh forward pass
    with torch.no_grad():
        logits = eng.model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).logits
    lp = sequence_logprobs(logits, batch["tokens"])
    assert float((lp - batch["rollout_logprobs"])[batch["action_mask"]].abs().max()) < 1e-5


def test_episode_token_budget_and_builder_errors():
    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=5))
    samples = [Sample("1+1=", "2", "x:0", {})]
    batch, builders = run_episodes(eng, EchoEnv, samples, TOK, SamplingParams(max_new_tokens=8, seed=1),
                                   limits=Limits(max_turns=5, max_episode_tokens=14))
    assert batch["attention_mask"].sum() <= 14
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        EpisodeBuilder([1]).add_action([3, 4], [-0.1])
    row = EpisodeBuilder([1, 5]).add_action([7], [-0.5]).add_observation([9, 9]).row(reward=1.0, group_id=3, version=2)
    b = stack_episodes([row])
    assert b["action_mask"].tolist() == [[False, False, True, False, False]]


def test_example_envs_reward_paths():
    ds = PromptDataset.from_parquet(DATA / "gsm8k_tiny.parquet")
    env = GSM8KCalculatorEnv(invalid_reward=-0.1)
    env.reset(ds[0])
    r = env.step('<tool>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool>')
    assert not r.done and r.observation == "<result>7</result>"
    r = env.step('<tool>{"name": "calculator", "arguments": {"expression": "import os"}}</tool>')
    assert r.reward == -0.1 and "error" in r.observation
    r = env.step("so #### 7")
    assert r.reward == 1.0 and r.info["success"] is True
    assert ENVIRONMENTS.factory("gsm8k_calculator").capabilities_for().reports_success  # declared at registration
    idx = BM25Index.from_jsonl(DATA / "corpus.jsonl")
    s = SearchEnv(idx)
    s.reset(Sample("What is the capital of France?", "Paris", "x:0", {}))
    r = s.step('<tool>{"name": "search", "arguments": {"query": "capital France"}}</tool>')
    assert "Paris" in r.observation and not r.done and r.info["tool_calls"] == 1
    r = s.step("<answer>Paris</answer>")
    assert r.reward == 1.0 and r.info["success"] is True
    assert s.step("<answer>Lyon</answer>").info["success"] is False


def test_agent_program_user_owned_loop():
    from hyperrl.envs import AgentProgram

    eng = TransformersEngine(tiny_qwen3(TOK.vocab_size, seed=6))

    def program(engine, sample):  # the user owns the loop: two turns with a fixed observation
        b = EpisodeBuilder(TOK.encode(sample.prompt))
        for _ in range(2):
            out = engine.generate([b.tokens], SamplingParams(max_new_tokens=4, seed=0))
            m = out["action_mask"][0]
            b.add_action(out["tokens"][0][m].tolist(), out["rollout_logprobs"][0][m].tolist())
            b.add_observation(TOK.encode("ok", add_special_tokens=False))
        return b.row(reward=0.5, group_id=0, version=engine.policy_version)

    assert isinstance(program, AgentProgram)
    batch = stack_episodes([program(eng, Sample("3+3=", "6", "x:0", {}))])
    assert int(batch["action_mask"].sum()) == 8 and batch["reward"].tolist() == [0.5]


def test_device_choice():
    from hyperrl.device import collective_backend, pick_device

    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type in ("cpu", "cuda", "npu")
    assert collective_backend(pick_device("cpu")) == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda.*use 'cpu' or 'auto'"):
            pick_device("cuda")
    with pytest.raises(RuntimeError, match="npu"):
        pick_device("npu")


def test_environment_capabilities_are_declared_at_registration():
    """Declared once where the environment registers, read from there: an undeclared one can do nothing extra, and
    a class still carrying an earlier release's attribute is refused naming the declaration to write."""
    from hyperrl.envs import EnvCapabilities, register_environment

    assert ENVIRONMENTS.factory("tool_chat").capabilities_for() == EnvCapabilities(takes_tools=True,
                                                                                   scores_final_turn=True)
    import hyperrl.agents  # noqa: F401 - registers the "agent" environment

    assert ENVIRONMENTS.factory("agent").capabilities_for().owns_loop
    try:
        @register_environment("plain_for_test")
        class Plain:
            def reset(self, sample):
                return ""

        assert ENVIRONMENTS.factory("plain_for_test").capabilities_for() == EnvCapabilities()
        with pytest.raises(TypeError, match=r"environment 'old_style': declare reports_success at registration — "
                                            r"register_environment\('old_style', capabilities=EnvCapabilities\("
                                            r"reports_success=True\)\)"):
            @register_environment("old_style")
            class OldStyle:
                reports_success = True
        assert "old_style" not in ENVIRONMENTS
    finally:
        ENVIRONMENTS.remove("plain_for_test")
