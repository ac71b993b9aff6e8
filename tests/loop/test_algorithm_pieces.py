"""An algorithm adds pieces, never edits the loop: a key provider and a loss term registered from this test file,
named in a recipe, run by the unchanged trainer — and the provider order, the refusals and the one-Trainer house."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperrl import transforms as T
from hyperrl.algorithms import KEY_PROVIDERS, LOSS_TERMS, Provided, provider_order
from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.config.recipes import RECIPES
from hyperrl.loop.collect import Collected, Timer
from hyperrl.loop.trainer import AsyncTrainer, PreferenceTrainer, SyncTrainer, Trainer

FAST = ["--model.hidden=32", "--model.layers=1", "--model.intermediate=64", "--rollout.prompts_per_step=4",
        "--rollout.n=4", "--run.eval_every=0", "--run.threads=1"]


@pytest.fixture
def toy():
    """``toy_weight`` = exp(old log-prob) (a key needing another key) and ``toy`` = coef·Σ w·log π / tokens (a term
    needing it), plus the recipe ``toy_grpo`` that lists the term; all unregistered after the test."""

    @KEY_PROVIDERS.register("toy_weight", needs=("old_logprobs",))
    def toy_weight(ctx, batch):
        return Provided({"toy_weight": batch["old_logprobs"].exp()}, {"toy_weight_mean": 1.0})

    @LOSS_TERMS.register("toy", needs=("toy_weight",))
    def toy_term(ctx, part, out, norm, *, coef: float = 0.5):
        m = part["action_mask"]
        return T.LossOutput({"loss_toy": coef * (out.logprobs * part["toy_weight"])[m].sum() / norm.num_tokens})

    RECIPES.add("toy_grpo", lambda: {"advantage": "grpo", "loss_terms": [{"name": "toy", "coef": 0.25}]})
    try:
        yield
    finally:
        KEY_PROVIDERS.remove("toy_weight")
        LOSS_TERMS.remove("toy")
        RECIPES.remove("toy_grpo")


def test_a_registered_key_and_term_named_by_a_recipe_train_without_editing_the_loop(tmp_path, toy):
    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path}", *FAST, "--algo.recipe=toy_grpo"]))
    try:
        assert [t.name for t in tr.pipeline.terms] == ["policy", "toy"]
        assert tr.pipeline.terms[1].fn.keywords == {"coef": 0.25}  # the recipe's value, not the default 0.5
        names = [p.name for p in tr.preparer.providers]
        assert names.index("old_logprobs") < names.index("toy_weight")  # its need first
        got = tr.collect(Timer())
        assert isinstance(got, Collected) and set(got.samples) == set(got.batch["group_id"].tolist())
        batch, metrics = tr.prepare(got.batch, samples=got.samples)
        assert metrics["toy_weight_mean"] == 1.0
        torch.testing.assert_close(batch["toy_weight"], batch["old_logprobs"].exp())
        batch = tr.pipeline.transform(batch)
        norm = T.Normalizer.from_mask(batch["action_mask"])
        out = tr.loss(batch, norm)
        lp, _ = tr.forwards.logprobs(tr.policy, batch)
        m = batch["action_mask"]
        by_hand = 0.25 * float((lp.detach() * batch["old_logprobs"].exp())[m].sum() / m.sum())
        assert float(out.terms["loss_toy"]) == pytest.approx(by_hand, rel=1e-5)
        assert set(out.terms) == {"loss_policy", "loss_toy"}  # the loss is the terms' sum
        assert float(out.loss) == pytest.approx(sum(float(v) for v in out.terms.values()), rel=1e-6)
        step = tr.step()
        assert "loss_toy" in step and "toy_weight_mean" in step and step["policy_version"] == 1
    finally:
        tr.close()


@pytest.mark.parametrize(("extra", "match"), [
    (["--algo.loss_terms=[nothing]"], r"algo.loss_terms\[0\]: unknown loss term 'nothing'; registered: \["),
    (["--algo.loss_terms=[{name: toy, coef: fast}]"], r"algo.loss_terms\[0\].coef: 'fast' is not a valid float"),
    (["--algo.loss_terms=[{name: toy, beta: 1}]"], r"algo.loss_terms\[0\].beta: loss term 'toy' takes no argument"),
])
def test_a_bad_loss_term_is_refused_at_load_naming_the_key(tmp_path, toy, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"--run.out_dir={tmp_path}", *extra])


def test_a_term_needing_a_key_nothing_provides_is_refused_at_load(tmp_path):
    @LOSS_TERMS.register("orphan", needs=("no_such_key",))
    def orphan(ctx, part, out, norm):
        return T.LossOutput({})

    try:
        with pytest.raises(ConfigError, match=r"algo.loss_terms\[0\]: loss term 'orphan' needs batch key "
                                              r"'no_such_key', which this run does not produce"):
            load_config(None, [f"--run.out_dir={tmp_path}", "--algo.loss_terms=[orphan]"])
    finally:
        LOSS_TERMS.remove("orphan")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["values", "baseline_reward", "teacher_logprobs", "sum_pi_squared", "old_logprobs",
                                 "m2po_keep", "ref_logprobs", "reward", "advantages"]), unique=True))
def test_providers_run_after_what_they_need_in_registration_order(wanted):
    order = provider_order(set(wanted))
    assert len(order) == len(set(order))
    assert set(order) >= {w for w in wanted if w in KEY_PROVIDERS}  # every wanted key with a provider
    assert not set(order) - set(wanted) - {"old_logprobs"}  # only what is wanted, and what that needs
    for i, key in enumerate(order):  # each after the providers of its needs
        assert all(order.index(n) < i for n in KEY_PROVIDERS.factory(key).needs if n in order)
    registered = KEY_PROVIDERS.in_order()
    assert order == sorted(order, key=registered.index)  # the built-ins' needs agree with registration order


def test_a_provider_cycle_is_refused_naming_it():
    KEY_PROVIDERS.register("cyc_a", needs=("cyc_b",))(lambda ctx, b: None)
    KEY_PROVIDERS.register("cyc_b", needs=("cyc_a",))(lambda ctx, b: None)
    try:
        with pytest.raises(ValueError, match="key providers: cyc_a → cyc_b → cyc_a is a cycle"):
            provider_order({"cyc_a"})
    finally:
        KEY_PROVIDERS.remove("cyc_a")
        KEY_PROVIDERS.remove("cyc_b")


def test_one_trainer_class_for_every_kind_of_run():
    assert SyncTrainer is AsyncTrainer is PreferenceTrainer is Trainer  # the earlier names, kept as aliases
