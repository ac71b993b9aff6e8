"""Defaults that fit the run: a task's declared settings for the keys a config leaves unset, a
pretrained checkpoint's learning rate, the output directory named from the config, and the
combinations refused at load (a group-relative advantage with one sample per prompt)."""

import json

import pytest

from hyperrl.config import ConfigError, describe, load_config
from hyperrl.config.load import CHECKPOINT_SETTINGS
from hyperrl.data.tasks import FILE_TASK_SETTINGS, TASKS
from tests.hf_fixtures import qwen3_checkpoint


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


@pytest.fixture
def files(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return f


def test_a_files_task_gets_its_declared_settings_where_the_config_is_silent(files):
    cfg = load_config(None, [f"--data.train_files=[{files}]"])
    assert TASKS.factory("files").settings == FILE_TASK_SETTINGS
    for key, value in FILE_TASK_SETTINGS.items():
        assert _get(cfg, key) == value, key  # not the arith toy's 3-token budget, 32 × 16 batch, 4,000 steps
    assert cfg.rollout.max_new_tokens == 512 and cfg.optim.lr == 1e-3  # no checkpoint: the random model's lr
    # what the user sets wins, key by key
    cfg = load_config(None, [f"--data.train_files=[{files}]", "--rollout.max_new_tokens=64", "--run.steps=7"])
    assert (cfg.rollout.max_new_tokens, cfg.run.steps, cfg.rollout.n) == (64, 7, 8)


def test_the_embedded_default_keeps_its_own_values():
    cfg = load_config()
    assert (cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.n, cfg.run.steps) == (3, 32, 16, 4000)
    assert cfg.run.out_dir == "runs/default" and load_config(None, ["--run.steps=10"]).run.out_dir == "runs/default"


def test_a_checkpoint_gets_a_pretrained_models_learning_rate(tmp_path, files):
    ck = qwen3_checkpoint(tmp_path / "ck")
    cfg = load_config(None, [f"--model.checkpoint={ck}", f"--data.train_files=[{files}]"])
    assert cfg.optim.lr == CHECKPOINT_SETTINGS["optim.lr"] == 1e-6
    assert load_config(None, [f"--model.checkpoint={ck}", "--optim.lr=3e-5"]).optim.lr == 3e-5
    assert cfg.model.checkpoint == str(ck.resolve())  # recorded absolute: export and resume from any directory


def test_the_output_directory_is_named_from_the_config(tmp_path, files):
    ck = qwen3_checkpoint(tmp_path / "ck")
    mine = [f"--model.checkpoint={ck}", f"--data.train_files=[{files}]"]
    a = load_config(None, mine).run.out_dir
    assert a.startswith("runs/files-") and a != "runs/default"  # a newcomer's second run: its own directory
    assert load_config(None, mine).run.out_dir == a  # the same command resumes its own run
    assert load_config(None, [*mine, "--run.steps=50", "--run.eval_every=5"]).run.out_dir == a  # longer: same run
    assert load_config(None, [*mine, "--optim.lr=1e-5"]).run.out_dir != a  # another hyperparameter: another run
    assert load_config(None, ["--run.seed=3"]).run.out_dir.startswith("runs/arith-")
    y = tmp_path / "my_exp.yaml"
    y.write_text("rollout: {n: 4}\n")
    assert load_config(y).run.out_dir.startswith("runs/my_exp-")
    assert load_config(y, ["--run.out_dir=elsewhere"]).run.out_dir == "elsewhere"


@pytest.mark.parametrize("over, match", [
    (["--rollout.n=1"], r"rollout.n=1: algo.advantage='grpo' .* group of one has advantage 0"),
    (["--rollout.n=1", "--algo.advantage=rloo"], r"algo.advantage='rloo'"),
    (["--rollout.n=1", "--algo.recipe=dapo"], r"rollout.n=1: "),
    (["--rollout.n=1", "--algo.advantage={name: grpo, singleton: raw}", "--algo.filter=dynamic_sampling"],
     r"algo.filter='dynamic_sampling' .* every update would be skipped"),
])
def test_one_sample_per_prompt_with_a_group_relative_advantage_is_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, over)


def test_one_sample_per_prompt_is_fine_without_groups():
    assert load_config(None, ["--rollout.n=1", "--algo.recipe=reinforce_pp"]).rollout.n == 1
    assert load_config(None, ["--rollout.n=1", "--algo.advantage.singleton=raw"]).rollout.n == 1


def test_hyperrl_config_lists_each_tasks_settings():
    text = describe()
    assert f"task files: {FILE_TASK_SETTINGS}" in text and f"model.checkpoint set: {CHECKPOINT_SETTINGS}" in text
