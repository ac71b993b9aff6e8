"""Conformance tables (as optax tests every optimizer): every registered name of every kind is built
from the default config and runs one step on the tiny model — or the config load fails with an error
naming the missing input. A new registration is picked up here without editing this file."""

import json
import math

import pytest
import torch

from hyperrl.algorithms.keys import baseline_reward
from hyperrl.algorithms.terms import BUILT_IN
from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.config.recipes import RECIPES, recipe_config
from hyperrl.config.resolve import registries
from hyperrl.envs import TOOLS, Tool
from hyperrl.rewards import is_factory
from tests.hf_fixtures import qwen3_checkpoint

_TINY = ["--task=modsum", "--run.threads=1", "--rollout.prompts_per_step=4", "--rollout.n=2",
         "--rollout.max_new_tokens=2",
         "--model.hidden=32", "--model.layers=1", "--model.heads=2", "--model.kv_heads=1", "--model.head_dim=16",
         "--model.intermediate=64", "--run.eval_prompts=4"]
_REG = registries()
PAIRS_TASK = "--task={name: preference, train_files: [tests/data/pairs_tiny.parquet]}"

# kind → (config key template, extra overrides a name of that kind needs to run)
_KINDS = {
    "algo.advantage": ("--algo.advantage={}", []),
    "algo.objective": ("--algo.objective={}", []),
    "algo.agg": ("--algo.agg={}", []),
    "algo.kl.estimator": ("--algo.kl.estimator={}", ["--algo.kl.coef=0.1"]),
    "algo.kl.controller": ("--algo.kl.controller={}", ["--algo.kl.coef=0.1"]),
    "algo.correction": ("--algo.correction={}", []),
    "algo.shaping": ("--algo.shaping=[{}]", []),
    "algo.filter": ("--algo.filter={}", ["--rollout.max_generation_batches=2"]),
    "optim.schedule": ("--optim.schedule={}", ["--optim.warmup_steps=1"]),
    "algo.preference": ("--algo.preference={}", [PAIRS_TASK]),
    "algo.loss_terms": ("--algo.loss_terms=[{}]", []),  # the built-in ones refused (the config turns them on)
    # one registry: a reward function runs as the task's reward, a reward factory from the rewards: list
    "rewards[].fn": (lambda name: f"--rewards=[{{fn: {name}}}]" if is_factory(name) else f"--task.rewards=[{name}]",
                     []),
    "task": ("--task={}", []),
    "env": ("--env={}", []),
    "rollout.engine": ("--rollout.engine={}", []),
    "async.executor": ("--async.executor={}", ["--async.max_staleness=1"]),
}
_RUNTIME_INPUTS = {  # what a name needs that the default config cannot know: given, or the load must fail naming it
    ("task", "parquet"): ["--task.path=tests/data/gsm8k_tiny.parquet"],
    ("env", "search_r1"): ["--env.corpus={corpus}"],
    ("env", "agent"): ["--env.program={agent}:solve", "--env.tool_format=none", "--env.isolate=false"],
    ("env", "tool_chat"): ["--tools=[{{name: calculator}}]", "--rewards=[{{fn: exact_answer}}]"],
    ("task", "files"): ["--task.train_files=[tests/data/gsm8k_tiny.parquet]"],
    ("task", "preference"): ["--task.train_files=[tests/data/pairs_tiny.parquet]", "--algo.recipe=dpo"],
    ("algo.objective", "dro"): ["--algo.objective={{name: dro, beta: 0.1}}"],  # verl requires dro_beta too
    ("rewards[].fn", "reward_model"): ["--rewards=[{{fn: reward_model, kwargs: {{path: {rm}}}}}]"],
    ("rewards[].fn", "remote"): ["--rewards=[{{fn: remote, kwargs: {{url: '{server}/score'}}}}]"],  # a real server
    ("rewards[].fn", "judge"): ["--rewards=[{{fn: judge, kwargs: {{model: {judge}, template: "
                                "'Rate {{{{ completion }}}}', max_new_tokens: 2}}}}]"],
}
_ROWS = {  # a name that needs rows the default task does not carry: its first step names what is missing, and it
    # runs one step on rows that carry it (verl's code rows: the unit tests as the ground truth)
    ("rewards[].fn", "code"): (r"code reward: row 0: no tests", ["--task=parquet",
                                                                   "--task.path=tests/data/code_tiny.parquet",
                                                                   "--rewards=[{fn: code, kwargs: {cpu_s: 1, "
                                                                   "wall_s: 3, workers: 2}}]"]),
    ("rewards[].fn", "program_passes"): (r"program_passes: the sample has no extra\['tests'\]",
                                         ["--task={name: postfix, rewards: [program_passes]}",
                                          "--rollout.max_new_tokens=8"]),
}

# valid, but beyond the tiny config's budget
_NEEDS = {("task", "arith"): ["--rollout.max_new_tokens=3"], ("task", "repeat"): ["--rollout.max_new_tokens=21"],
          ("task", "products"): ["--rollout.max_new_tokens=6"], ("task", "postfix"): ["--rollout.max_new_tokens=8"],
          ("task", "shapes"): ["--model.vision={}", "--rollout.max_new_tokens=2"]}  # a visual task: a VLM


def _reward_model_dir(path):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from hyperrl.tokenizer import char_tokenizer

    tok = char_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, num_labels=1, pad_token_id=0)
    Qwen3ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _reward_server(tmp_path) -> str:
    """tests/rewards/reward_server.py started for this test (ended at exit: it dies with the test's process)."""
    import atexit
    import subprocess
    import sys
    import time

    port = tmp_path / "port"
    p = subprocess.Popen([sys.executable, "tests/rewards/reward_server.py", str(port)])
    atexit.register(p.kill)
    deadline = time.time() + 20
    while not port.exists():
        assert time.time() < deadline and p.poll() is None, "the reward server did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port.read_text()}"


def _cases():
    for kind, (tmpl, extra) in _KINDS.items():
        for name in _REG[kind].names():
            ray = (kind, name) == ("async.executor", "ray")
            marks = [pytest.mark.xdist_group("ray"), pytest.mark.ray, pytest.mark.slow] if ray else []
            override = tmpl(name) if callable(tmpl) else tmpl.format(name)
            yield pytest.param(kind, name, override, extra, id=f"{kind}:{name}", marks=marks)
    for name in _REG["algo.kl.estimator"].names():
        yield pytest.param("algo.kl.estimator", name + "+", f"--algo.kl.estimator={name}+", ["--algo.kl.coef=0.1"],
                           id=f"algo.kl.estimator:{name}+")


def test_every_kind_is_in_the_table():
    assert set(_KINDS) | {"tools"} == set(_REG), "a new kind of plug-in needs a row in the conformance table"


def _step(tmp_path, overrides):
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", *_TINY, *overrides])
    tr = build_trainer(cfg)
    m = tr.step()
    assert m["step"] == 1
    assert m["policy_version"] == 1 - m.get("update_skipped", 0) == tr.engine.policy_version
    for k, v in m.items():
        if isinstance(v, float) and k != "reward_mean":
            assert math.isfinite(v), (k, v)
    return tr, m


@pytest.mark.parametrize("kind, name, override, extra", list(_cases()))
def test_every_registered_name_runs_one_step_or_names_what_is_missing(tmp_path, kind, name, override, extra):
    need = _RUNTIME_INPUTS.get((kind, name))
    extra = extra + _NEEDS.get((kind, name), [])
    if need is not None:  # without its input the load must fail naming the dotted key
        key = r"rewards\[0\]\.kwargs" if kind == "rewards[].fn" else kind.replace(".", r"\.")
        with pytest.raises(ConfigError, match=rf"{key}\.\w+: .*'{name}' needs"):
            load_config(None, [override])
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("\n".join(json.dumps({"text": t}) for t in ("paris is in france", "rome is in italy")))
        rm = _reward_model_dir(tmp_path / "rm") if kind == "rewards[].fn" else None
        agent = tmp_path / "agent.py"  # one OpenAI call through the gateway; the reward its answer's first char
        agent.write_text("def solve(sample, client):\n"
                         "    r = client.chat.completions.create(model='hyperrl-policy', "
                         "messages=[{'role': 'user', 'content': str(sample.prompt)}])\n"
                         "    return float((r.choices[0].message.content or ' ')[:1] == str(sample.answer)[:1])\n")
        server = _reward_server(tmp_path) if (kind, name) == ("rewards[].fn", "remote") else None
        judge = qwen3_checkpoint(tmp_path / "judge") if (kind, name) == ("rewards[].fn", "judge") else None
        extra = extra + [x.format(corpus=corpus, rm=rm, agent=agent, server=server, judge=judge) for x in need]
        if kind == "rewards[].fn":
            override = extra.pop()
    if kind == "algo.loss_terms" and name in BUILT_IN:  # listed by the pipeline from its own config keys
        with pytest.raises(ConfigError, match=rf"algo\.loss_terms\[0\]: loss term '{name}' is built in"):
            load_config(None, [override])
        return
    if (kind, name) == ("rollout.engine", "vllm") and _REG[kind].factory(name).requires:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:  # this environment: the load must say how to install it
            with pytest.raises(ConfigError, match="vllm is not installed"):
                load_config(None, [override])
            return
    if (kind, name) in _ROWS:
        from hyperrl.rewards import RewardError

        missing, rows = _ROWS[kind, name]
        with pytest.raises(RewardError, match=missing):
            _step(tmp_path / "default", [override, *extra])
        extra = extra + rows
    tr, _ = _step(tmp_path, [override, *extra])
    getattr(tr, "close", lambda: None)()  # an asynchronous run's workers (a Ray the run started)


@pytest.mark.parametrize("recipe", RECIPES.names())
def test_every_recipe_runs_one_step(tmp_path, recipe):
    pairs = "preference" in recipe_config(recipe)  # DPO and kin train on pairs
    tr, m = _step(tmp_path, [f"--algo.recipe={recipe}", *([PAIRS_TASK] if pairs else [])])
    if pairs:
        assert "loss_dpo" in m and tr.reference is not None
    assert tr.cfg.algo.recipe == recipe
    if recipe == "ppo":
        assert tr.critic is not None and "loss_value" in m
    if recipe == "grpo":
        assert tr.reference is not None and "loss_kl" in m


@pytest.mark.parametrize("name", TOOLS.names())
def test_every_tool_builds_and_answers(name):
    tool = TOOLS.build(name)()
    assert isinstance(tool, Tool) and tool.name == name and tool.schema
    args = {k: "1+2" for k in tool.schema.get("properties", {})}
    assert isinstance(tool.fn(**args), str)


def test_gdpo_fills_reward_components_from_several_rewards(tmp_path):
    tr, m = _step(tmp_path, ["--algo.recipe=gdpo", "--task.rewards=[first_char_exact, starts_with_digit]"])
    assert "reward_first_char_exact_mean" in m and "reward_starts_with_digit_mean" in m
    assert m["reward_mean"] == pytest.approx(m["reward_first_char_exact_mean"] + m["reward_starts_with_digit_mean"])


def test_remax_baseline_is_a_greedy_rollout(tmp_path):
    tr, _ = _step(tmp_path, ["--algo.recipe=remax"])
    samples = tr.task.sample(4, 0)
    batch = tr.scorer.score(tr.engine.generate([tr.task.encode(s) for s in samples], tr.generator.sampling(0), 2),
                           dict(enumerate(samples)))
    ctx = tr.preparer.context(samples=dict(enumerate(samples)))  # what the key provider reads
    base = baseline_reward(ctx, batch)
    assert base.shape == (8,) and torch.equal(base[0::2], base[1::2])  # one baseline per group
    assert torch.equal(base, baseline_reward(ctx, batch))  # greedy: the same every time
