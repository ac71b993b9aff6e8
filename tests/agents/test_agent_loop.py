"""The calculator task through an agent program (configs/calculator_agent.yaml): the trainer, the
gateway, the agent process and the official ``openai`` client end to end."""

from __future__ import annotations

import re

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.tokenizer import CHAR_CHAT_TEMPLATE, char_tokenizer
from tests.loop.test_tool_task import logit_grads

CFG = "configs/calculator_agent.yaml"
CHAR = char_tokenizer()


def _trainer(tmp_path, *extra):
    cfg = load_config(CFG, [f"--run.out_dir={tmp_path}", "--model.hidden=32", "--model.intermediate=64",
                            "--optim.shared_prefix=false", "--run.threads=1", *extra])
    return build_trainer(cfg)


@pytest.mark.parametrize("template", ["config", "default"])
def test_observation_tokens_never_enter_the_loss(tmp_path, template):
    """A real round of 512 agent episodes (a random policy calls with p ≈ 1/95: seeded, several do):
    the observation the gateway appended has action mask 0 and the loss's gradient at the logits
    predicting it is exactly 0, nonzero at the sampled tokens. With the config's compact template the
    observation is the tool result alone (the built-in environment's sequence); with the character
    tokenizer's default template (``model.chat_template`` as a ``.jinja`` file) it is the template's
    ``\ntool: [09716]\nassistant: ``."""
    from hyperrl.loop.collect import Timer

    extra = []
    if template == "default":
        (tmp_path / "char.jinja").write_text(CHAR_CHAT_TEMPLATE)
        extra = [f"--model.chat_template={tmp_path / 'char.jinja'}"]
    tr = _trainer(tmp_path, *extra)
    try:
        got = tr.collect(Timer())
        batch, info = got.batch, got.metrics
        called = batch["tool_calls"] > 0
        assert int(called.sum()) >= 1 and info["agent_failed"] == 0 and info["agent_episodes"] == 512
        assert info["agent_calls"] == 512 + int(called.sum())
        batch, _ = tr.prepare(batch)
        batch = tr.pipeline.transform(batch)
        act, attn = batch["action_mask"], batch["attention_mask"]
        obs = attn & ~act & (torch.cumsum(act.int(), -1) > 0)
        assert bool(obs[called].any()) and not bool(obs[~called].any())
        row = int(called.nonzero()[0])
        text = CHAR.decode(batch["tokens"][row][obs[row]].tolist())
        # the template's closing of the call turn (the <eos> when the response ran into max_new_tokens), the
        # tool turn, the next generation prompt
        if template == "default":
            assert text.removeprefix("<eos>").startswith("\ntool: [") and text.endswith("]\nassistant: ")
        else:
            assert re.fullmatch(r"(<eos>)?\[\d{5}\]", text), text
            whole = CHAR.decode(batch["tokens"][row][attn[row]].tolist())
            assert re.fullmatch(r"<bos>\d{3}\*\d{2}=\?.*<eos>\[\d{5}\].+", whole), whole
        g, a = logit_grads(tr, batch)
        assert float(g[obs[:, a:]].abs().max()) == 0.0
        assert float(g[act[:, a:]].abs().max()) > 0.0
    finally:
        tr.close()


def test_a_step_and_an_evaluation_through_the_agent(tmp_path):
    """``hyperrl``'s own step and evaluation with the agent: the agent metrics, success from the
    program's ``AgentResult``, every episode one row."""
    tr = _trainer(tmp_path, "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.eval_prompts=8")
    try:
        m = tr.step()
        e = tr.evaluate()
    finally:
        tr.close()
    assert m["agent_episodes"] == 16 and m["agent_rows"] == 16 and m["agent_failed"] == 0
    assert 0 <= m["success_rate"] <= 1 and "eval_success_rate" in e and "eval_tool_call_rate" in e
    assert tr.generator.driver.agent.gateway is None  # closed with the trainer


@pytest.mark.slow
def test_the_agent_learns_to_call_the_tool_in_a_short_ci_run(tmp_path):
    """From random weights, fixed seed: the held-out tool-call rate through the agent rises from the
    random policy's ≈ 1/95 to most episodes within 40 steps, and the reward with it (success needs
    ≈ 200–300 steps: benchmarks/RESULTS.md)."""
    tr = build_trainer(load_config(CFG, [f"--run.out_dir={tmp_path}", "--run.threads=1", "--run.eval_prompts=64"]))
    try:
        first = tr.evaluate()
        for _ in range(40):
            m = tr.step()
        last = tr.evaluate()
    finally:
        tr.close()
    assert first["eval_tool_call_rate"] < 0.05 and first["eval_success_rate"] == 0.0
    assert last["eval_tool_call_rate"] > 0.5 and m["tool_call_rate"] > 0.5
    assert last["eval_reward_mean"] > first["eval_reward_mean"] + 0.05
