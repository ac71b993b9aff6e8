"""The in-code tasks (arith), their rewards, the per-token credit split, and what a reward reads."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.data.tasks import TASKS, arith_problems
from hyperrl.rewards.builtin import REWARDS, digit_credit, digit_match, exact_answer
from hyperrl.tokenizer import char_tokenizer, decode_response

CHAR = char_tokenizer()


def test_arith_problems_cover_every_pair_and_never_go_negative():
    p = arith_problems("+-", 0, 99)
    assert len(p) == 100 * 100 + 100 * 101 // 2  # every sum; differences only for a ≥ b
    assert all(ans >= 0 and ans == (a + b if op == "+" else a - b) for a, op, b, ans in p)
    assert {len(str(ans)) for *_, ans in p} == {1, 2, 3}
    assert len(arith_problems("+", 10, 19)) == 100


TWO_DIGIT = {"ops": "+-", "max_operand": 99, "pad": False}


def test_arith_holds_out_problems_it_never_trains_on():
    task = TASKS.build("arith", **TWO_DIGIT)(CHAR, 0)
    held = {s.prompt for s in task.held_out(10**6)}
    assert len(held) == round(0.1 * len(arith_problems("+-", 0, 99)))
    seen = {s.prompt for step in range(50) for s in task.sample(64, step)}
    assert not held & seen and len(seen) > 2000
    # the split is the run seed's business only for the training draw: every seed evaluates on one set
    assert {s.prompt for s in TASKS.build("arith", **TWO_DIGIT)(CHAR, 7).held_out(10**6)} == held
    again = TASKS.build("arith", **TWO_DIGIT)(CHAR, 0)
    assert [s.prompt for s in task.sample(8, 3)] == [s.prompt for s in again.sample(8, 3)]
    default = TASKS.build("arith")(CHAR, 0)  # the factory's defaults: sums of 0..49 at a fixed width, 250 held out
    assert len(default.held_out(10**6)) == 250 and default.response_tokens == 3 and task.response_tokens == 4
    s = task.sample(1, 0)[0]
    a, op, b = s.prompt[:-1].replace("-", " - ").replace("+", " + ").split()
    assert s.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b))
    assert task.encode(s) == CHAR.encode(s.prompt)


def test_a_task_tokenises_each_distinct_prompt_once_and_hands_out_copies(monkeypatch):
    import hyperrl.data.incode as incode
    from hyperrl.tokenizer import encode_prompt

    task = TASKS.build("arith")(CHAR, 0)
    samples = [s for step in range(6) for s in task.sample(64, step)]
    calls = []
    real = incode.encode_prompt
    monkeypatch.setattr(incode, "encode_prompt", lambda tok, p: calls.append(p) or real(tok, p))
    got = [task.encode(s) for s in samples]
    assert got == [encode_prompt(CHAR, s.prompt) for s in samples]
    assert sorted(calls) == sorted({s.prompt for s in samples}) and len(calls) < len(samples)  # repeats: once
    got[0].append(-1)  # a caller's list is its own: the kept ids are unchanged
    assert task.encode(samples[0]) == encode_prompt(CHAR, samples[0].prompt)
    monkeypatch.setattr(incode, "ENCODED_KEPT", 4)  # bounded: past the cap it starts over, same ids
    fresh = TASKS.build("arith")(CHAR, 0)
    assert [fresh.encode(s) for s in samples[:10]] == [encode_prompt(CHAR, s.prompt) for s in samples[:10]]
    assert 1 <= len(fresh._encoded) <= 4



@pytest.mark.parametrize("args, match", [({"ops": "*"}, "task.ops"), ({"ops": "++"}, "task.ops"),
                                         ({"min_operand": 5, "max_operand": 3}, "min_operand"),
                                         ({"held_out_frac": 1.0}, "held_out_frac")])
def test_arith_bad_hyperparameters_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        TASKS.build("arith", **args)(CHAR, 0)


def test_a_response_budget_too_short_for_the_answers_is_named_before_building(tmp_path):
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--task=arith", "--task.max_operand=99", "--task.pad=false",
                             "--rollout.max_new_tokens=1"])
    with pytest.raises(ValueError, match="rollout.max_new_tokens=1: task 'arith' has answers of up to 3 tokens"):
        build_trainer(cfg)


def test_repeat_has_a_long_tail_of_answer_lengths_and_holds_out_pairs():
    task = TASKS.build("repeat")(CHAR, 0)
    draws = [s for step in range(40) for s in task.sample(64, step)]
    lengths = torch.tensor([len(s.answer) for s in draws], dtype=torch.float)
    tail = lengths >= 12
    assert abs(float(tail.float().mean()) - 0.2) < 0.03  # tail_frac of the prompts, 4–8× longer
    assert set(lengths[~tail].long().tolist()) <= {1, 2, 3} and set(lengths[tail].long().tolist()) <= set(range(12, 21))
    assert all(s.answer == s.prompt[0] * int(s.prompt[2:-1]) for s in draws[:50])
    held = {s.prompt for s in task.held_out(10**6)}
    assert len(held) == round(0.15 * 10 * (3 + 9)) and not held & {s.prompt for s in draws}
    assert task.response_tokens == 21
    with pytest.raises(ValueError, match="task.short_max"):
        TASKS.build("repeat", short_max=12)(CHAR, 0)


class _S:
    def __init__(self, answer):
        self.answer = answer


def test_exact_and_digit_credit_golden():
    # answer "85": target "85⏹" (3 shares of 1/3); the longest common prefix earns its shares
    for resp, credit in [("85", 1), ("8", 1 / 3), ("84", 1 / 3), ("851", 2 / 3), ("5", 0), ("", 0)]:
        assert digit_credit(resp, _S("85")) == pytest.approx(credit)
        assert exact_answer(resp, _S("85")) == float(resp == "85")
    assert REWARDS.get("digit_credit") is digit_credit


def test_digit_match_golden():
    # answer "085" (fixed width): target "085⏹", 4 positions of 1/4 each, compared place by place
    for resp, credit in [("085", 1), ("075", 3 / 4), ("08", 2 / 4), ("0851", 3 / 4), ("185", 3 / 4), ("", 0),
                         ("58", 1 / 4), ("5", 0)]:  # "58⏹" vs "085⏹": only the 8 is in place
        assert digit_match(resp, _S("085")) == pytest.approx(credit)
    assert REWARDS.get("digit_match") is digit_match


@given(st.text(alphabet="0123456789", max_size=5), st.integers(0, 999))
def test_digit_match_is_one_exactly_on_the_answer_and_never_below_the_prefix_credit(resp, answer):
    assert (digit_match(resp, _S(answer)) == 1.0) == (exact_answer(resp, _S(answer)) == 1.0)
    assert digit_match(resp, _S(answer)) >= digit_credit(resp, _S(answer)) - 1e-12


def test_arith_pad_writes_fixed_width_operands_and_answers():
    task = TASKS.build("arith", pad=True)(CHAR, 0)  # sums of 0..49: operands 2 digits, answers 2 (00..98)
    for s in task.sample(64, 0) + task.held_out(10**6):
        a, b = s.prompt[:-1].split("+")
        assert len(a) == len(b) == 2 and len(s.answer) == 2 and int(s.answer) == int(a) + int(b)
    assert task.response_tokens == 3 and {s.source for s in task.held_out(10**6)} == \
        {s.source for s in TASKS.build("arith", pad=False)(CHAR, 0).held_out(10**6)}  # the same held-out problems
    plain = TASKS.build("arith", pad=False)(CHAR, 0).sample(16, 3)  # the same draw, written without padding
    assert [s.source for s in plain] == [s.source for s in task.sample(16, 3)]
    assert all(int(p.answer) == int(q.answer) for p, q in zip(plain, task.sample(16, 3)))


@given(st.text(alphabet="0123456789x", max_size=6), st.integers(0, 198), st.booleans())
def test_the_token_split_of_digit_credit_sums_to_it(resp, answer, stopped):
    pieces = [*resp, *([None] if stopped else [])]
    split = digit_credit.token_credit(pieces, _S(answer))
    assert len(split) == len(pieces) and all(v >= 0 for v in split)
    # an unstopped response never earns the stop's share: it is the credit of resp + a non-digit
    want = digit_credit(resp, _S(answer)) if stopped else digit_credit(resp + "x", _S(answer))
    assert sum(split) == pytest.approx(want)


def test_a_special_token_mid_answer_stays_visible_to_the_reward():
    # a policy sampling <pad> between digits must not have it hidden ("8<pad>5" is not "85"):
    # skip_special_tokens would decode it as "85" — a reward hack the tiny policy found
    ids = CHAR.encode("85", add_special_tokens=False)
    assert decode_response(CHAR, [ids[0], CHAR.pad_token_id, ids[1]]) == "8<pad>5"
    assert decode_response(CHAR, [*ids, CHAR.eos_token_id, CHAR.pad_token_id, CHAR.pad_token_id]) == "85"
    two_turns = [ids[0], CHAR.eos_token_id, ids[1], CHAR.eos_token_id]  # turn ends dropped, turns kept
    assert decode_response(CHAR, two_turns) == "85"
    assert decode_response(CHAR, [ids[0], 7, ids[1]], stops=[7]) == "85"


def test_process_supervised_grpo_gets_token_rewards_that_sum_to_the_reward(tmp_path):
    args = [f"--run.out_dir={tmp_path}", "--run.threads=1", "--task=arith", "--task.max_operand=9",
            "--task.rewards=[digit_credit, exact_answer]", "--algo.advantage=grpo_process",
            "--rollout.prompts_per_step=4", "--rollout.n=4", "--rollout.max_new_tokens=3",
            "--model.hidden=32", "--model.layers=1", "--model.intermediate=64", "--run.steps=2"]
    cfg = load_config(None, args)
    tr = build_trainer(cfg)
    samples = tr.task.sample(4, 0)
    batch = tr.scorer.score(tr.generator.generate(samples, tr.generator.sampling(0), 4), dict(enumerate(samples)))
    tok = batch["token_rewards"]
    assert (tok[~batch["action_mask"]] == 0).all()
    torch.testing.assert_close(tok.sum(-1), batch["reward"])
    comps = batch["reward_components"]  # digit credit is split over the tokens; the exact bonus is on the last
    torch.testing.assert_close(batch["reward"], comps.sum(-1))
    m = tr.step()
    assert m["step"] == 1 and torch.isfinite(torch.tensor(m["reward_mean"]))
    # shaping that changes the reward (clipped to [0.25, 0.5] here) keeps Σ_t token_rewards = reward: the
    # change lands on the last token
    clipped = build_trainer(load_config(None, [*args, "--algo.shaping=[{name: clip, lo: 0.25, hi: 0.5}]"]))
    from hyperrl.loop.collect import Timer

    batch = clipped.collect(Timer()).batch
    assert float(batch["reward"].min()) == 0.25 and float(batch["reward"].max()) <= 0.5  # the clip binds
    torch.testing.assert_close(batch["token_rewards"].sum(-1), batch["reward"])


def test_the_end_of_run_plot_shows_reward_pass_at_k_entropy_length_and_tool_rate(tmp_path):
    import json

    from hyperrl.loop.hooks import plot_rewards

    rows = [{"event": "step", "step": s, "reward_mean": s / 10, "entropy": 2 - s / 10, "response_len_mean": 3.0,
             "tool_call_rate": s / 20, "success_rate": s / 30} for s in range(1, 11)]
    rows += [{"event": "eval", "step": s, "eval_reward_mean": s / 12, "eval_pass_at_k": s / 11, "eval_n": 4,
              "eval_response_len_mean": 3.0, "eval_tool_call_rate": s / 15, "eval_success_rate": s / 16,
              "eval_reward_exact_answer_mean": s / 13,
              "eval_reward_digit_credit_mean": s / 12} for s in (0, 5, 10)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = plot_rewards(tmp_path / "m.jsonl", tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert drawn["reward"] == ["train reward (batch mean)", "held-out mean@4", "held-out pass@4",
                               "held-out digit_credit", "held-out exact_answer"]
    assert drawn["entropy"] == ["train (action tokens)"]
    assert drawn["response length (tokens)"] == ["train", "held-out"]
    assert drawn["tool calls and success"] == ["tool-call rate (train)", "tool-call rate (held-out)",
                                               "success (train)", "success (held-out)"]
    # a single-turn run with eval_n = 1: no pass@k series, no tool panel
    single = [r for r in rows if r["event"] == "step" or r.update(eval_n=1) or True]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if "tool" not in k
                                                          and "success" not in k}) + "\n" for r in single))
    drawn = plot_rewards(tmp_path / "s.jsonl", tmp_path / "s.png")
    assert "tool calls and success" not in drawn and "held-out pass@1" not in drawn["reward"]
    # a multi-turn run whose environment gives no verdict: the tool-call rate without success series
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if "success" not in k}) + "\n"
                                              for r in rows))
    assert plot_rewards(tmp_path / "t.jsonl", tmp_path / "t.png")["tool calls and success"] == [
        "tool-call rate (train)", "tool-call rate (held-out)"]


@pytest.mark.slow
def test_the_arith_task_shows_a_clear_rise_short_ci_config(tmp_path):
    # the arith task shrunk for CI (sums of 0..4: a digit + EOS), fixed seed: exact match from ≈0 (a
    # random policy emits the right 2 tokens with p ≈ 1e-4) to a clear share of the training batch in
    # 120 steps (≈15 s), the dense credit with it
    cfg = load_config(None, [f"--run.out_dir={tmp_path}", "--run.threads=1", "--task=arith", "--task.max_operand=4",
                             "--task.pad=false", "--task.rewards=[digit_credit,exact_answer]",
                             "--algo.entropy_coef=0.05", "--rollout.max_new_tokens=3", "--rollout.prompts_per_step=32",
                             "--rollout.n=8",
                             "--model.hidden=64", "--model.intermediate=128", "--optim.lr=3e-3", "--run.steps=120"])
    tr = build_trainer(cfg)
    ms = [tr.step() for _ in range(cfg.run.steps)]
    exact = [m["reward_exact_answer_mean"] for m in ms]
    assert sum(exact[:10]) / 10 < 0.05, exact[:10]
    assert sum(exact[-10:]) / 10 > 0.4, exact[-10:]
    assert sum(m["reward_digit_credit_mean"] for m in ms[-10:]) / 10 > 0.4
