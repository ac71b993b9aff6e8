"""The tool-use task: ``products`` (arithmetic a tiny model cannot do in its head) with the
``calculator_copy`` environment — the compact ``?`` call for the character model, a tool-call format
(hermes through a real chat template) for a real tokenizer; success reported apart from the reward
shaping; observation tokens never in the loss."""

import json

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.data import Sample
from hyperrl.data.tasks import TASKS, arith_problems
from hyperrl.envs import ENVIRONMENTS, CalculatorCopyEnv, Limits, run_episodes
from hyperrl.sampling import SamplingParams
from hyperrl.tokenizer import char_tokenizer
from hyperrl.transforms import Normalizer
from tests.foundations.test_tokenizer import ScriptedEngine
from tests.hf_fixtures import bpe_tokenizer, qwen3_checkpoint

CHAR = char_tokenizer()
CALC = "configs/calculator.yaml"


def test_products_are_fixed_width_with_a_calculator_expression_and_held_out_pairs():
    task = TASKS.build("products")(CHAR, 0)
    # 900 × 90 = 81,000 pairs, 2 % held out; 100*10 = 1000 (4 digits) ... 999*99 = 98901 (5 digits)
    assert len(arith_problems("*", 100, 999, 10, 99)) == 81_000 and len(task.held_out(10**6)) == 1_620
    assert task.response_tokens == 6  # five digits + EOS
    held = {s.prompt for s in task.held_out(10**6)}
    seen = [s for step in range(20) for s in task.sample(64, step)]
    assert not held & {s.prompt for s in seen}
    for s in seen[:50]:
        a, b = s.prompt[:-1].split("*")
        assert len(a) == 3 and len(b) == 2 and s.answer == f"{int(a) * int(b):05d}"
        assert s.extra["expression"] == f"{int(a)}*{int(b)}"
    s = task._sample((347, "*", 28, 347 * 28))
    assert (s.prompt, s.answer, s.extra["expression"]) == ("347*28=", "09716", "347*28")
    # arith keeps its prompts; its expressions drop the padding (a calculator cannot parse "07")
    s = TASKS.build("arith")(CHAR, 0)._sample((7, "+", 25, 32))
    assert (s.prompt, s.answer, s.extra["expression"]) == ("07+25=", "32", "7+25")
    with pytest.raises(ValueError, match="task.min_first"):
        TASKS.build("products", min_first=5, max_first=3)(CHAR, 0)


SAMPLE = Sample("347*28=", "09716", "arith:347*28", {"expression": "347*28"})


def test_the_compact_call_the_observation_and_the_answer():
    env = CalculatorCopyEnv()
    assert env.reset(SAMPLE) == "347*28="
    r = env.step("?x")  # begins with "?": the calculator on the question, padded to the answer's width
    assert (r.observation, r.reward, r.done, r.info) == ("[09716]", 0.1, False, {"tool_calls": 1})
    r = env.step("09716")
    assert (r.reward, r.done, r.info["success"]) == (1.0, True, True)
    env.reset(SAMPLE)
    r = env.step("09736")  # no call: this is the answer; 5 of the 6 places of "09716" + EOS
    assert r.done and r.reward == pytest.approx(5 / 6) and r.info["success"] is False
    env.reset(SAMPLE)
    env.step("?")
    r = env.step("?09716")  # past max_calls a "?" response is the answer (and wrong)
    assert r.done and r.info["success"] is False and "tool_calls" not in r.info
    env.reset(Sample("What is two times three?", "6", "x:0", {}))  # no expression: an error observation, no crash
    r = env.step("?")
    assert r.observation == "[error: SyntaxError]" and r.reward == 0.0 and not r.done
    env = CalculatorCopyEnv(call_reward=0.0, max_calls=2)
    env.reset(SAMPLE)
    assert env.step("?").reward == 0.0 and not env.step("?").done and env.step("09716").reward == 1.0


def test_bad_environment_hyperparameters_are_named(tmp_path):
    with pytest.raises(ValueError, match="env.max_calls=0"):
        CalculatorCopyEnv(max_calls=0)
    with pytest.raises(Exception, match="format"):
        load_config(CALC, ["--env.format=xml", f"--run.out_dir={tmp_path}"])


def test_native_formats_parse_the_call_and_read_the_last_number():
    bpe = bpe_tokenizer()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*28"}}</tool_call>'
    eng = ScriptedEngine(bpe, [call + "<|im_end|>", "So it is 9716.<|im_end|>"])
    sp = SamplingParams(max_new_tokens=64, eos_id=bpe.eos_token_id, seed=0)
    sample = Sample("347*28=", "9716", "t:0", {"expression": "347*28"})
    batch, builders = run_episodes(eng, lambda: CalculatorCopyEnv(format="hermes"), [sample], bpe, sp,
                                   limits=Limits(max_turns=2, max_episode_tokens=512),
                                   capabilities=ENVIRONMENTS.factory("calculator_copy").capabilities_for())
    assert batch["tool_calls"].tolist() == [1] and batch["success"].tolist() == [1.0]
    assert float(batch["reward"][0]) == pytest.approx(1.1)  # the exact answer + the call's shaping
    kinds = [k for k, _, _ in builders[0].segments]
    assert kinds == ["prompt", "action", "observation", "action"]
    _, s, e = builders[0].segments[2]
    assert "<tool_response>\n9716\n</tool_response>" in bpe.decode(batch["tokens"][0, s:e].tolist())
    assert not batch["action_mask"][0, s:e].any()
    env = CalculatorCopyEnv(format="hyperrl")  # the compact tags: the model writes its own expression
    env.reset(sample)
    r = env.step('<tool>{"name": "calculator", "arguments": {"expression": "347*27"}}</tool>')
    assert r.observation == "<result>9369</result>" and r.reward == 0.1
    assert env.step("it is 9369").info["success"] is False


def _calculator_trainer(tmp_path, *extra):
    cfg = load_config(CALC, [f"--run.out_dir={tmp_path}", "--model.hidden=32", "--model.intermediate=64",
                             "--optim.shared_prefix=false", "--run.threads=1", *extra])
    return build_trainer(cfg)


def logit_grads(tr, batch):
    """The real loss's gradient with respect to the logits of the plain forward (``[B, T − a, V]``,
    predicting tokens ``a … T − 1``) and ``a``."""
    kept = {}

    def keep(module, args, logits):
        logits.retain_grad()
        kept["logits"] = logits

    act = batch["action_mask"]
    hook = tr.policy.lm_head.register_forward_hook(keep)
    try:
        tr.loss(batch, Normalizer.from_mask(act, tr.cfg.rollout.max_new_tokens)).loss.backward()
    finally:
        hook.remove()
    g = kept["logits"].grad
    return g, batch["tokens"].shape[1] - g.shape[1]


def test_observation_tokens_never_enter_the_loss(tmp_path):
    """A real rollout of the compact task (a random policy calls with p ≈ 1/95 per episode: 512
    episodes, seeded), the real loss: its gradient with respect to the logits that predict the
    observation tokens is exactly 0, and nonzero at the action tokens."""
    from hyperrl.loop.collect import Timer

    tr = _calculator_trainer(tmp_path)
    batch = tr.collect(Timer()).batch
    called = batch["tool_calls"] > 0
    assert int(called.sum()) >= 1
    batch, _ = tr.prepare(batch)
    batch = tr.pipeline.transform(batch)
    act, attn = batch["action_mask"], batch["attention_mask"]
    obs = attn & ~act & (torch.cumsum(act.int(), -1) > 0)  # after the row's first action: the observation tokens
    assert bool(obs[called].any()) and not bool(obs[~called].any())
    # the observation text is the calculator's result, never sampled
    row = int(called.nonzero()[0])
    assert CHAR.decode(batch["tokens"][row][obs[row]].tolist()).startswith("[")
    g, a = logit_grads(tr, batch)
    assert a == int(act.int().argmax(-1)[act.any(-1)].min())  # the batch's first action position
    assert float(g[obs[:, a:]].abs().max()) == 0.0
    assert float(g[act[:, a:]].abs().max()) > 0.0


def test_the_run_with_a_real_tokenizer_and_the_native_format(tmp_path):
    """The same task and environment from a real chat checkpoint: hermes tool calls through its
    chat template (a random model rarely writes one; the run must work, report the tool-call and
    success rates, and score the final message by its last number)."""
    ckpt = qwen3_checkpoint(tmp_path / "qwen3", seed=2)
    args = [f"--model.checkpoint={ckpt}", "--task.pad=false", "--env.format=hermes", "--rollout.prompts_per_step=2",
            "--rollout.n=2", "--rollout.max_new_tokens=8", "--run.eval_prompts=2"]
    # the chat prompt lists the tool's schema: 282 tokens, more than the default episode budget — named
    with pytest.raises(ValueError, match=r"first prompt has 282 tokens.*rollout.max_episode_tokens"):
        _calculator_trainer(tmp_path / "small", *args).step()
    tr = _calculator_trainer(tmp_path / "out", *args, "--rollout.max_episode_tokens=400")
    assert tr.generator.driver.env().tools[0]["function"]["name"] == "calculator"
    m = tr.step()
    assert {"tool_call_rate", "success_rate"} <= set(m)
    e = tr.evaluate()
    assert 0.0 <= e["eval_success_rate"] <= 1.0 and "eval_tool_call_rate" in e
    assert json.dumps(m)  # plain numbers


@pytest.mark.slow
def test_the_tool_task_learns_to_call_in_a_short_ci_run(tmp_path):
    """The compact tool task from random weights, fixed seed, one thread: the held-out tool-call
    rate rises from the random policy's ≈ 1/95 to most episodes within 40 steps (seed 0 on two
    threads: 0.008 → 0.76 at step 30), and the reward with it. (Copying the result to exact
    success takes ≈ 200–300 steps: benchmarks/RESULTS.md, "the tool-use task".)"""
    tr = build_trainer(load_config(CALC, [f"--run.out_dir={tmp_path}", "--run.threads=1", "--run.eval_prompts=64"]))
    first = tr.evaluate()
    for _ in range(40):
        m = tr.step()
    last = tr.evaluate()
    assert first["eval_tool_call_rate"] < 0.05 and first["eval_success_rate"] == 0.0
    assert last["eval_tool_call_rate"] > 0.5 and m["tool_call_rate"] > 0.5
    assert last["eval_reward_mean"] > first["eval_reward_mean"] + 0.05
