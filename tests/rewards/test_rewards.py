"""Rewards as users write them: TRL-style and verl-style functions from a file, weighted, routed by
data_source, batched; math-verify; a reward model; bad rewards named."""

import textwrap

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.data import Sample
from hyperrl.rewards import RewardError, build_rewards

USER_REWARDS = '''
calls = []

def accuracy(prompts, completions, completion_ids, answer, **kw):
    calls.append(len(completions))  # TRL calls once per batch
    return [float(c.startswith(a)) for c, a in zip(completions, answer)]

def only_long(prompts, completions, **kw):
    return [None if len(c) < 2 else 0.5 for c in completions]  # None: not applicable

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 2.0

def short(prompts, completions, **kw):
    return [1.0]

def text(prompts, completions, **kw):
    return ["yes" for _ in completions]

def nan(prompts, completions, **kw):
    return [float("nan") for _ in completions]
'''


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(USER_REWARDS)
    return f


def _specs(tmp_path, rewards: str, *extra):
    y = tmp_path / "c.yaml"
    y.write_text(textwrap.dedent(rewards))
    return load_config(y, [f"--run.out_dir={tmp_path / 'run'}", *extra])


SAMPLES = [Sample("1+2=", "3", "a", {"data_source": "math"}), Sample("hi", "ok", "b", {"data_source": "chat"}),
           Sample("4+4=", "8", "c", {"data_source": "math"})]


def test_trl_and_verl_functions_from_a_file_weighted_and_routed(tmp_path, user_file):
    cfg = _specs(tmp_path, f"""
        rewards:
          - {{fn: "{user_file}:accuracy", style: trl, weight: 2.0}}
          - {{fn: "{user_file}:only_long", style: trl, abstains: true}}
          - {{fn: "{user_file}:compute_score", style: verl, data_source: chat, name: exact}}
    """)
    rs = build_rewards(cfg.rewards)
    texts = ["3", "ok", "80"]
    comps, app, metrics = rs.score([s.prompt for s in SAMPLES], texts, [[1], [2, 3], [4, 5]], SAMPLES)
    # accuracy: 1, 0 ("ok" does not start with "ok"? it does: 1), 1 ("80" starts with "8");
    # only_long: None, 0.5, 0.5; exact (chat rows only): -, 1 ("ok" == "ok"), -
    assert comps.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.5, 1.0], [1.0, 0.5, 0.0]]
    assert app.tolist() == [[True, False, False], [True, True, True], [True, True, False]]
    assert rs.total(comps).tolist() == [2.0, 3.5, 2.5]  # Σ w·r: 2·1, 2·1 + 0.5 + 1, 2·1 + 0.5
    assert metrics == {"reward_exact_length_mean": 2.0}  # the verl dict's extra key, over its rows
    assert rs.names == ("accuracy", "only_long", "exact")


def test_a_trl_reward_is_called_once_per_batch_with_the_columns(tmp_path, user_file):
    cfg = _specs(tmp_path, f'rewards: [{{fn: "{user_file}:accuracy", style: trl}}]')
    rs = build_rewards(cfg.rewards)
    rs.score([s.prompt for s in SAMPLES], ["3", "x", "8"], [[1]] * 3, SAMPLES)
    mod = rs.rewards[0].fn.__globals__
    assert mod["calls"] == [3]


def test_chat_prompts_give_trl_chat_completions(tmp_path):
    f = tmp_path / "chat_rewards.py"
    f.write_text("def kind(prompts, completions, **kw):\n"
                 "    return [float(isinstance(c, list) and c[0]['role'] == 'assistant') for c in completions]\n")
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{f}:kind", style: trl}}]').rewards)
    chat = Sample([{"role": "user", "content": "hi"}], "ok", "x", {})
    comps, _, _ = rs.score([chat.prompt, "plain"], ["a", "b"], [[1], [2]], [chat, SAMPLES[0]])
    assert comps[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("fn, match", [("short", "returned 1 values for 3 completions"),
                                       ("text", "returned str 'yes'; expected a number — batch row 0"),
                                       ("nan", "returned nan; rewards must be finite.* — batch row 0")])
def test_bad_reward_values_name_the_reward_and_row(tmp_path, user_file, fn, match):
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{user_file}:{fn}", style: trl}}]').rewards)
    with pytest.raises(RewardError, match=f"reward '{fn}'.*{match}" if "values" not in match else match):
        rs.score([s.prompt for s in SAMPLES], ["3", "x", "8"], [[1]] * 3, SAMPLES)


def test_reward_files_that_cannot_be_used_fail_at_load(tmp_path, user_file):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    cases = [(f'rewards: [{{fn: "{tmp_path}/missing.py:f", style: trl}}]', r"rewards\[0\].fn: .*missing.py does not"),
             (f'rewards: [{{fn: "{broken}:f", style: trl}}]', r"rewards\[0\].fn: importing .*broken.py failed: "
                                                               "ModuleNotFoundError"),
             (f'rewards: [{{fn: "{user_file}:nope", style: trl}}]', r"has no function 'nope' \(it defines"),
             (f'rewards: [{{fn: "{user_file}:accuracy"}}]', r"rewards\[0\].style: .* calling convention"),
             ('rewards: [not_a_reward]', r"rewards\[0\].fn: 'not_a_reward' is neither"),
             ('rewards: [{fn: reward_model}]', r"rewards\[0\].kwargs.path: .* needs 'path'")]
    for text, match in cases:
        with pytest.raises(ConfigError, match=match):
            _specs(tmp_path, text)


def test_math_verify_reward_checks_equivalence(tmp_path):
    rs = build_rewards(_specs(tmp_path, "rewards: [math_verify]").rewards)
    samples = [Sample("q", "1/2", "a", {}), Sample("q", "\\frac{1}{2}", "b", {}), Sample("q", "3", "c", {})]
    comps, _, _ = rs.score(["q"] * 3, ["so \\boxed{0.5}", "the answer is $0.5$", "\\boxed{4}"], [[1]] * 3, samples)
    assert comps[:, 0].tolist() == [1.0, 1.0, 0.0]


def test_a_reward_model_scores_batches_like_one_forward(tmp_path):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from tests.hf_fixtures import bpe_tokenizer

    tok = bpe_tokenizer()
    torch.manual_seed(0)
    rm = Qwen3ForSequenceClassification(Qwen3Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                    intermediate_size=64, num_labels=1,
                                                    pad_token_id=tok.pad_token_id))
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    texts = ["The answer is 42.", "no", "Tom has 3 apples"]
    scores = {}
    for bs in (1, 16):
        rs = build_rewards(_specs(tmp_path, f"rewards: [{{fn: reward_model, kwargs: {{path: {tmp_path / 'rm'}, "
                                            f"batch_size: {bs}}}}}]").rewards)
        scores[bs] = rs.score(["Q: "] * 3, texts, [[1]] * 3, SAMPLES)[0][:, 0]
    rm.eval()
    with torch.no_grad():
        ref = [float(rm(**tok("Q: " + t, return_tensors="pt")).logits[0, 0]) for t in texts]
    assert torch.allclose(scores[1], torch.tensor(ref), atol=1e-5)
    assert torch.allclose(scores[16], scores[1], atol=1e-5)  # padded batches score the same


def test_configured_rewards_drive_a_training_step_and_gdpo_weights(tmp_path, user_file):
    rewards = f"""
        rewards:
          - {{fn: "{user_file}:accuracy", style: trl, weight: 1.0}}
          - {{fn: starts_with_digit, weight: 0.5}}
    """
    tiny = ["--rollout.prompts_per_step=8", "--rollout.n=4", "--model.hidden=32", "--model.intermediate=64",
            "--run.threads=1"]
    tr = build_trainer(_specs(tmp_path, rewards, *tiny))
    m = tr.step()
    assert {"reward_accuracy_mean", "reward_starts_with_digit_mean"} <= set(m)
    assert m["reward_mean"] == pytest.approx(m["reward_accuracy_mean"] + 0.5 * m["reward_starts_with_digit_mean"])
    gdpo = _specs(tmp_path, rewards, "--algo.recipe=gdpo", *tiny)
    assert gdpo.algo.advantage.args["weights"] == [1.0, 0.5]  # the rewards' weights, one per component


def test_a_reward_file_signature_is_checked_against_its_style_at_load(tmp_path, user_file):
    # accuracy is TRL-style (prompts, completions, ...): declared verl it cannot take solution_str
    with pytest.raises(ConfigError, match=r"rewards\[0\].style: verl calls .*accuracy.*set style: trl"):
        _specs(tmp_path, f'rewards: [{{fn: "{user_file}:accuracy", style: verl}}]')
    # compute_score is verl-style: declared trl it has no completions
    with pytest.raises(ConfigError, match=r"rewards\[0\].style: trl calls .*no 'completions'.*set style: verl"):
        _specs(tmp_path, f'rewards: [{{fn: "{user_file}:compute_score", style: trl}}]')
    _specs(tmp_path, f'rewards: [{{fn: "{user_file}:compute_score", style: verl}}]')  # as declared: loads


RAISING = '''
def none(prompts, completions, **kw):
    return None

def nones(prompts, completions, **kw):
    return [None for _ in completions]

def boom(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "x":
        raise ZeroDivisionError("division by zero")
    return 1.0

def inf(prompts, completions, **kw):
    return [1.0, float("inf"), 0.0]

def mutate(prompts, completions, **kw):
    for p in prompts:
        if isinstance(p, list):
            p[0]["content"] += " MUTATED"
    prompts.clear()
    return [0.0 for _ in completions]
'''


@pytest.mark.parametrize("fn, style, match", [
    ("none", "trl", r"reward 'none' \(trl style\) returned NoneType None; expected a list of 3 numbers"),
    ("nones", "trl", r"reward 'nones' returned None; .*abstains: true.* — batch row 0"),
    ("boom", "verl", r"reward 'boom' raised ZeroDivisionError: division by zero — batch row 1"),
    ("inf", "trl", r"reward 'inf' returned inf; rewards must be finite.* — batch row 1")])
def test_every_reward_failure_is_a_reward_error_naming_reward_and_row(tmp_path, fn, style, match):
    f = tmp_path / "bad.py"
    f.write_text(RAISING)
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{f}:{fn}", style: {style}}}]').rewards)
    with pytest.raises(RewardError, match=match):
        rs.score([s.prompt for s in SAMPLES], ["3", "x", "8"], [[1]] * 3, SAMPLES)


def test_an_abstaining_reward_marks_its_none_rows_not_applicable(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(RAISING)
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{f}:nones", style: trl, abstains: true}}]').rewards)
    comps, app, _ = rs.score([s.prompt for s in SAMPLES], ["3", "x", "8"], [[1]] * 3, SAMPLES)
    assert app.tolist() == [[False]] * 3 and comps.tolist() == [[0.0]] * 3


def test_a_reward_cannot_change_the_dataset_it_is_given(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(RAISING)
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{f}:mutate", style: trl}}]').rewards)
    chat = Sample([{"role": "user", "content": "hi"}], "ok", "x", {})
    samples = [chat, SAMPLES[0]]
    prompts = [s.prompt for s in samples]
    rs.score(prompts, ["a", "b"], [[1], [2]], samples)
    assert chat.prompt == [{"role": "user", "content": "hi"}] and len(prompts) == 2


def test_a_reward_past_its_timeout_is_stopped_and_named(tmp_path):
    import time

    f = tmp_path / "slow.py"
    f.write_text("import time\ndef slow(prompts, completions, **kw):\n    time.sleep(60)\n    return [1.0]\n"
                 "def spin(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    while True:\n        pass\n")
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{f}:slow", style: trl, timeout_s: 0.5}}]').rewards)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward 'slow' did not return within rewards\[\].timeout_s=0.5 s; it "
                                          r"was stopped \(one call on 3 rows\)"):
        rs.score([s.prompt for s in SAMPLES], ["3", "x", "8"], [[1]] * 3, SAMPLES)
    assert time.perf_counter() - t0 < 5
    rs = build_rewards(_specs(tmp_path, f'rewards: [{{fn: "{f}:spin", style: verl, timeout_s: 0.3}}]').rewards)
    with pytest.raises(RewardError, match=r"reward 'spin' did not return .* — batch row 0"):
        rs.score([s.prompt for s in SAMPLES], ["3", "x", "8"], [[1]] * 3, SAMPLES)
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no timer left behind


def test_a_registered_reward_style_calls_its_functions_its_own_way(tmp_path):
    """A calling convention is a registered :class:`RewardStyle` (``REWARD_STYLES``), not a string switch: a style
    added from a test file is accepted at load, checks a file function's signature and calls it its own way."""
    import inspect

    from hyperrl.rewards.calling import REWARD_STYLES, Call, RewardStyle, register_reward_style

    @register_reward_style("by_answer")
    class ByAnswer(RewardStyle):
        """fn(answer, text) per row."""

        calls = "fn(answer, text)"

        def make_calls(self, reward, prompts, texts, ids, samples):
            return [Call((i,), (s.answer, t)) for i, (t, s) in enumerate(zip(texts, samples))]

        def unfit(self, sig, kwargs):
            return None if list(sig.parameters)[:2] == ["answer", "text"] else "it does not take (answer, text)"

    f = tmp_path / "mine.py"
    f.write_text("def score(answer, text):\n    return float(text == answer)\n\n"
                 "def other(prompts, completions, **kw):\n    return [0.0]\n")
    try:
        cfg = _specs(tmp_path, f'rewards: [{{fn: "{f}:score", style: by_answer}}]')
        rs = build_rewards(cfg.rewards)
        comps, applicable, _ = rs.score(["p"] * 3, ["3", "no", "9"], [[1]] * 3, SAMPLES)
        assert comps[:, 0].tolist() == [1.0, 0.0, 0.0] and applicable.all()
        with pytest.raises(ConfigError, match=r"rewards\[0\].style: by_answer calls fn\(answer, text\), which other"
                                              r".* cannot take — it does not take \(answer, text\); .*set style: trl"):
            _specs(tmp_path, f'rewards: [{{fn: "{f}:other", style: by_answer}}]')
    finally:
        REWARD_STYLES.remove("by_answer")
    with pytest.raises(ConfigError, match=r"rewards\[0\].style: 'by_answer' is not a registered reward style"):
        _specs(tmp_path, f'rewards: [{{fn: "{f}:score", style: by_answer}}]')
    assert inspect.isclass(REWARD_STYLES.get("verl")) and REWARD_STYLES.in_order() == ["trl", "verl", "hyperrl"]
