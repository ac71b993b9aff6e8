"""Inputs that cannot corrupt a run: YAML read with the 1.2 core schema and no duplicate keys, no
boolean where a number goes, no NaN or infinity anywhere, and every declared hyperparameter range
checked at load — each refusal naming the key."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.config import ConfigError, load_config
from hyperrl.config.yaml12 import DuplicateKeyError, load


@pytest.mark.parametrize("text, value", [
    ("010", 10), ("1:30", "1:30"), ("yes", "yes"), ("on", "on"), ("true", True), ("False", False),
    ("1e-6", 1e-6), ("0x1f", 31), ("0o17", 15), ("-3", -3), ("2.5", 2.5), ("'010'", "010"), ("null", None),
])
def test_yaml_numbers_and_booleans_follow_the_12_core_schema(text, value):
    got = load(text)
    assert got == value and type(got) is type(value)


@given(st.integers(-10**12, 10**12))
def test_every_decimal_integer_reads_as_itself_even_with_leading_zeros(n):
    text = ("-" if n < 0 else "") + "00" + str(abs(n))
    assert load(text) == n


def test_a_repeated_key_is_refused_naming_it_and_its_lines(tmp_path):
    with pytest.raises(DuplicateKeyError, match=r"key 'run' appears twice .* \(lines 1 and 3\)"):
        load("run: {steps: 3}\nmodel: {}\nrun: {seed: 1}\n")
    y = tmp_path / "c.yaml"
    y.write_text("run:\n  steps: 3\nrollout: {n: 4}\nrun:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"c.yaml: key 'run' appears twice"):
        load_config(y)


@pytest.mark.parametrize("over, match", [
    ("--run.seed=010", None),  # 10, not octal 8
    ("--run.steps=1:30", r"run.steps: '1:30' is not valid"),
    ("--rollout.n=true", r"rollout.n: True is not valid — .*expected a number, got the boolean True"),
    ("--optim.lr=.inf", r"optim.lr: inf is not valid — Input should be a finite number"),
    ("--optim.lr=.nan", r"optim.lr: nan is not valid"),
    ("--rewards=[{fn: digit_match, weight: .inf}]", r"rewards.0.weight: inf is not valid"),
    ("--rewards=[{fn: digit_match, weight: .nan}]", r"rewards.0.weight: nan is not valid"),
    ("--algo.objective.clip_low=-1", r"algo.objective.clip_low: -1 is not a valid float \(Input should be greater"),
    ("--algo.objective.clip_high=.inf", r"algo.objective.clip_high: inf is not a finite number"),
    ("--algo.objective.dual_clip=0.5", r"algo.objective.dual_clip: 0.5 .* greater than 1"),
    ("--algo.advantage.eps=true", r"algo.advantage.eps: expected a number, got the boolean True"),
    ("--algo.shaping=[{name: overlong, buffer: 0}]", r"algo.shaping\[0\].buffer: 0 is not a valid int or None"),
    ("--algo.correction={name: tis, cap: -2}", r"algo.correction.cap: -2 .* greater than 0"),
    ("--algo.advantage={name: gae, gamma: 1.5}", r"algo.advantage.gamma: 1.5 .* less than or equal to 1"),
])
def test_bad_values_are_refused_at_load_naming_the_key(over, match):
    if match is None:
        assert load_config(None, [over]).run.seed == 10
        return
    with pytest.raises(ConfigError, match=match):
        load_config(None, [over])


def test_a_negative_reward_weight_is_a_choice_not_an_error():
    assert load_config(None, ["--rewards=[{fn: digit_match, weight: -0.5}]"]).rewards[0].weight == -0.5
