"""The config is checked completely at load time: variants against their factories, factory defaults
the only defaults, errors naming the dotted key — and nothing built."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hyperrl.transforms as T
from hyperrl.config import ConfigError, load_config
from hyperrl.config.recipes import RECIPES, recipe_config

PAIRS = ["--data.train_files=[tests/data/pairs_tiny.parquet]"]  # what a preference recipe (dpo, ipo) trains on


def test_gspo_and_gmpo_get_their_own_clips_never_ppos():
    # the old bug: AlgoConfig.clip_low/high (0.2 / 0.28) went to whichever objective took them
    assert load_config(None, ["--algo.objective=gspo"]).algo.objective.args["clip_low"] == 3e-4
    assert load_config(None, ["--algo.objective=gspo"]).algo.objective.args["clip_high"] == 4e-4
    assert load_config(None, ["--algo.recipe=gspo"]).algo.objective.args == {"clip_low": 3e-4, "clip_high": 4e-4,
                                                                              "log_ratio_max": 10.0}
    g = load_config(None, ["--algo.recipe=gmpo"]).algo.objective.args
    assert g["clip_low"] == g["clip_high"] == 0.4
    # switching the objective of a recipe that tuned ppo_clip drops ppo_clip's arguments
    d = load_config(None, ["--algo.recipe=dapo", "--algo.objective=cispo"]).algo.objective
    assert d.name == "cispo" and d.args["clip_high"] == 0.28 and d.args["eps_max"] == 5.0  # cispo's own defaults


def test_same_name_merges_arguments_across_layers(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("algo: {recipe: dapo, objective: {clip_high: 0.3}}\n")
    obj = load_config(y, ["--algo.objective.clip_low=0.1"]).algo.objective
    assert obj.name == "ppo_clip" and obj.args["clip_high"] == 0.3 and obj.args["clip_low"] == 0.1
    # a string override then an argument of the new variant
    obj = load_config(y, ["--algo.objective=gspo", "--algo.objective.clip_low=1e-4"]).algo.objective
    assert obj.name == "gspo" and obj.args["clip_low"] == 1e-4 and obj.args["clip_high"] == 4e-4


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["advantage", "objective", "correction", "filter"]), data=st.data())
def test_factory_defaults_are_the_only_defaults(kind, data):
    reg = {"advantage": T.ADVANTAGES, "objective": T.OBJECTIVES, "correction": T.CORRECTIONS,
           "filter": T.FILTERS}[kind]
    name = data.draw(st.sampled_from(reg.names()))
    # the RL recipes: a preference recipe (dpo, ipo) trains on pairs and refuses filters and corrections
    recipe = data.draw(st.sampled_from([n for n in RECIPES.names() if "preference" not in recipe_config(n)]))
    required = {p.name: 0.5 for p in reg.factory(name).params.values() if p.required}  # dro's beta: verl has none
    given = [f"--algo.{kind}.{k}={v}" for k, v in required.items()]
    spec = getattr(load_config(None, [f"--algo.recipe={recipe}", f"--algo.{kind}={name}", *given]).algo, kind)
    base = recipe_config(recipe).get(kind)
    base = {"name": base} if isinstance(base, str) else (base or {})
    # a new name starts from the factory's defaults; the same name keeps the recipe's own arguments
    kept = {k: v for k, v in base.items() if k != "name"} if base.get("name") == name else {}
    assert spec.name == name and spec.args == {**reg.factory(name).defaults(), **kept, **required}
    assert set(spec.args) == set(reg.factory(name).params)  # every hyperparameter, nothing else


def test_every_kernel_knob_is_reachable():
    cfg = load_config(None, [
        "--algo.advantage=grpo", "--algo.advantage.singleton=raw", "--algo.objective.dual_clip=3.0",
        "--algo.objective.delta=4.0", "--algo.kl.coef=0.01", "--algo.kl.clamp_input=20", "--algo.kl.clamp_output=10",
        "--algo.kl.controller=adaptive", "--algo.kl.controller.target=0.05", "--algo.correction=tis",
        "--algo.correction.cap=3", "--algo.correction.level=sequence"])
    a = cfg.algo
    assert a.advantage.args["singleton"] == "raw" and a.objective.args["dual_clip"] == 3.0
    assert a.objective.args["delta"] == 4.0 and a.kl.clamp_input == 20.0 and a.kl.controller.args["target"] == 0.05
    assert a.correction.args == {"cap": 3.0, "level": "sequence"}
    rpp = load_config(None, ["--algo.recipe=reinforce_pp", "--algo.advantage.gamma=0.9",
                             "--algo.advantage.masked=discount"]).algo.advantage.args
    assert rpp["gamma"] == 0.9 and rpp["masked"] == "discount"
    sapo = load_config(None, ["--algo.recipe=sapo", "--algo.objective.tau_neg=2"]).algo.objective.args
    assert sapo["tau_neg"] == 2.0 and sapo["tau_pos"] == 1.0


def test_dict_and_list_values(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("env: {name: gsm8k_calculator, invalid_reward: -0.5, max_calls_per_turn: 1}\n"
                 "task: {name: modsum, rewards: [first_char_exact, starts_with_digit]}\n"
                 "algo: {shaping: [{name: clip, lo: -1, hi: 1}, {name: overlong, buffer: 1}]}\n")
    cfg = load_config(y, ["--rollout.max_new_tokens=4"])
    assert cfg.env.args == {"invalid_reward": -0.5, "max_calls_per_turn": 1, "format": "hyperrl"}
    assert cfg.task.args["rewards"] == ("first_char_exact", "starts_with_digit")
    assert [s.name for s in cfg.algo.shaping] == ["clip", "overlong"]
    assert cfg.algo.shaping[1].args == {"max_len": 4, "buffer": 1}  # the response budget filled in


def _needs_foo(batch, *, x: int = 1):
    return {"advantages": batch["action_mask"].float()}


@pytest.mark.parametrize("overrides, message", [
    (["--algo.advantage=grpoo"], r"algo.advantage: unknown advantage estimator 'grpoo'; registered: \['batch_std'"),
    (["--algo.objective.clip_hgh=0.3"], r"algo.objective.clip_hgh: policy objective 'ppo_clip' takes no argument "
                                        r"'clip_hgh'; its hyperparameters: clip_low=0.2"),
    (["--algo.objective.clip_low=wide"], r"algo.objective.clip_low: 'wide' is not a valid float"),
    (["--algo.recipe=grpo_v2"], r"algo.recipe: unknown recipe 'grpo_v2'; registered: \["),
    (["--env=search_r1"], r"env.corpus: environment 'search_r1' needs 'corpus' \(a str\); set it in the config"),
    (["--task=parquet"], r"task.path: task 'parquet' needs 'path'"),
    (["--task.rewards=[exact]"], r"task.rewards: \['exact'\] is not a valid tuple .*unknown reward function 'exact'"),
    (["--optim.schedule=cosin"], r"optim.schedule: unknown lr schedule 'cosin'"),
    (["--algo.kl.estimator=k9"], r"algo.kl.estimator: unknown KL estimator 'k9'"),
    (["--algo.kl.controller=pid"], r"algo.kl.controller: unknown KL controller 'pid'"),
    (["--algo.correction.cap=2"], r"algo.correction: .*a variant needs a 'name'"),
    (["--algo.advantage=needs_foo"], r"algo.advantage: advantage estimator 'needs_foo' needs batch key 'foo', "
                                     r"which this run does not produce"),
    (["--rollout.n=0"], r"rollout.n: 0 is not valid — Input should be greater than or equal to 1"),
    (["--algo.bogus=1"], r"unknown config key 'algo.bogus'; valid keys under algo: \['advantage'"),
    (["--model.alphabet=x+x"], r"model.alphabet='x\+x': needs distinct characters \(repeated: \['x'\]\)"),
    (["--model.alphabet=x+", "--model.tokenizer=/tok"], r"model.alphabet is the embedded character tokenizer's, for "
                                                          r"a random init; with model.checkpoint or model.tokenizer"),
    (["--run.eval_greedy=true", "--run.eval_n=4"], r"run.eval_greedy with run.eval_n=4: greedy answers are all the "
                                                    r"same; set eval_n 1"),
])
def test_bad_input_names_the_key_and_the_fix(overrides, message, monkeypatch):
    monkeypatch.setattr(T.ADVANTAGES, "_items", dict(T.ADVANTAGES._items))
    T.ADVANTAGES.add("needs_foo", _needs_foo, needs=("foo",))
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.slow
def test_cli_bad_config_builds_nothing(tmp_path):
    out = tmp_path / "run"
    bad = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", f"--run.out_dir={out}",
                          "--algo.advantage=grpoo"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "algo.advantage: unknown advantage estimator 'grpoo'" in bad.stderr
    assert not out.exists()  # no model, engine, output directory or process group was made


@pytest.mark.slow
def test_hyperrl_config_lists_every_key_and_variant():
    from hyperrl.cli import main

    out = subprocess.run([sys.executable, "-m", "hyperrl.cli", "config"], capture_output=True, text=True,
                         timeout=120).stdout
    for key in ("model.hidden = 128", "rollout.max_generation_batches = 4", "algo.recipe = 'grpo_clip_higher'",
                "algo.kl.controller", "optim.schedule = 'constant'", "run.out_dir = 'runs/default'"):
        assert key in out, key
    assert "gspo(clip_low=0.0003, clip_high=0.0004, log_ratio_max=10.0)" in out
    assert "remax(baseline_key='baseline_reward')  needs ['reward', 'baseline_reward']" in out
    for name in RECIPES.names():
        assert f"  {name}: " in out, name
    assert main(["config", "--algo.recipe=sapo"]) == 0


def test_resolved_config_round_trips_through_json(tmp_path):
    for name in RECIPES.names():
        cfg = load_config(None, [f"--algo.recipe={name}", *(PAIRS if "preference" in recipe_config(name) else [])])
        assert cfg.algo.recipe == name and recipe_config(name)["recipe"] == name
        y = tmp_path / f"{name}.yaml"
        y.write_text(json.dumps(cfg.to_dict()))  # JSON is YAML: a run's config.json reloads to itself
        assert load_config(y) == cfg


def test_tensor_parallel_settings_are_checked_at_load(monkeypatch):
    with pytest.raises(ConfigError, match="run.tp=2: needs torchrun"):
        load_config(None, ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="needs the engine split the same way"):
        load_config(None, ["--run.tp=2"])  # a whole engine per rank could sample different rows per TP peer
    with pytest.raises(ConfigError, match="needs the engine split the same way"):
        load_config(None, ["--rollout.engine={name: transformers, tp: 2}"])
    with pytest.raises(ConfigError, match="model.lora"):
        load_config(None, ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}", "--model.lora={r: 4}"])
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match="multiple of 4"):
        load_config(None, ["--run.tp=4", "--rollout.engine={name: transformers, tp: 4}"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config(None, ["--run.tp=2", "--rollout.engine={name: transformers, tp: 2}"]).run.tp == 2
