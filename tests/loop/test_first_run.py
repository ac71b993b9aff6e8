"""What a newcomer's first run shows: clipped responses measured and warned about, every reward
logged (one too) and the raw score beside a shaped one, a reward failure named by step, row and
sample, and prompts encoded the way ``data.apply_chat_template`` says."""

import json
import warnings

import pytest
import torch
from tensordict import TensorDict

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.data import render_chat
from hyperrl.data.tasks import FileTask
from hyperrl.loop.hooks import clip_warning
from hyperrl.loop.scoring import Scorer
from hyperrl.rewards import RewardError
from hyperrl.tokenizer import char_tokenizer, encode_prompt
from tests.hf_fixtures import bpe_tokenizer


def test_clipped_rows_are_those_whose_last_action_token_is_no_stop():
    tok = char_tokenizer()
    eos, a, b = tok.eos_token_id, tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    # rows: [prompt, a, eos] ended; [prompt, a, b] cut off; [prompt, a, 7(stop id), pad] ended by a stop id;
    # [prompt, pad, pad] no action token: not clipped
    tokens = torch.tensor([[5, a, eos, 0], [5, a, b, 0], [5, a, 7, 0], [5, 0, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    batch = TensorDict({"tokens": tokens, "action_mask": mask}, batch_size=[4])
    scorer = Scorer(tok, task=None, stop_ids=(7,))
    assert scorer.clipped(batch).tolist() == [False, True, False, False]


def test_the_clip_warning_is_said_once_and_never_for_the_untrained_evaluation():
    said = []
    hook = clip_warning(3, window=4, say=said.append)
    hook("eval", None, {"step": 0, "eval_response_clipped_frac": 1.0})  # random weights: expected, not warned
    for step in range(1, 5):
        hook("step", None, {"step": step, "response_clipped_frac": 1.0})
    assert said == []  # the first window is the untrained policy's
    for step in range(5, 9):
        hook("step", None, {"step": step, "response_clipped_frac": 0.2})
    assert said == []  # mean 0.2 over the window
    for step in range(9, 17):
        hook("step", None, {"step": step, "response_clipped_frac": 0.9})
    hook("eval", None, {"step": 16, "eval_response_clipped_frac": 0.95})
    assert len(said) == 1 and "90% of responses hit rollout.max_new_tokens=3" in said[0]
    assert "over steps 9–12" in said[0] and "raise rollout.max_new_tokens" in said[0]


def test_one_reward_is_logged_by_name_and_the_raw_score_beside_a_shaped_one(tmp_path):
    cfg = load_config(None, ["--task=modsum", "--rollout.max_new_tokens=2", "--rollout.prompts_per_step=4",
                             "--rollout.n=4", "--algo.shaping=[{name: overlong, buffer: 1}]", "--run.eval_prompts=8",
                             f"--run.out_dir={tmp_path}", "--run.threads=1"])
    tr = build_trainer(cfg)
    m = tr.step()
    assert "reward_first_char_exact_mean" in m and m["reward_first_char_exact_applicable_frac"] == 1.0
    assert 0.0 <= m["response_clipped_frac"] <= 1.0
    # the overlong penalty makes reward_mean differ from the raw score exactly on the clipped rows
    assert m["reward_raw_mean"] == pytest.approx(m["reward_first_char_exact_mean"])
    assert m["reward_mean"] <= m["reward_raw_mean"] + 1e-9
    e = tr.evaluate()
    assert {"eval_reward_first_char_exact_mean", "eval_response_clipped_frac"} <= set(e)


def test_a_reward_that_raises_is_named_with_its_step_row_and_sample(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(6)))
    rewards = tmp_path / "r.py"
    rewards.write_text("def boom(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    raise KeyError('score')\n")
    cfg = load_config(None, [f"--data.train_files=[{data}]", f"--rewards=[{{fn: '{rewards}:boom', style: verl}}]",
                             "--rollout.max_new_tokens=2", "--rollout.prompts_per_step=2", "--rollout.n=2",
                             "--run.eval_every=0", f"--run.out_dir={tmp_path / 'run'}", "--run.threads=1"])
    tr = build_trainer(cfg)
    with pytest.raises(RewardError) as err:
        tr.step()
    msg = str(err.value)
    assert msg.startswith("step 1: reward 'boom' raised KeyError: 'score' — batch row 0 (sample_uid 0, prompt ")
    assert "train.jsonl:" in msg


def test_apply_chat_template_auto_always_never(recwarn):
    tok = bpe_tokenizer()
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}]
    chat = [{"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "answer": "7"}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = FileTask(tok, rows)
    said = [str(w.message) for w in caught if "chat template" in str(w.message)]
    assert len(said) == 1 and "data.apply_chat_template=always" in said[0]  # once, with the fix
    assert auto.encode(auto.dataset[0]) == encode_prompt(tok, "What is 3 + 4?")  # the raw text
    always = FileTask(tok, rows, apply_chat_template="always")
    assert always.encode(always.dataset[0]) == encode_prompt(tok, chat[0]["prompt"])  # a user turn, templated
    never = FileTask(tok, chat, apply_chat_template="never")
    assert never.encode(never.dataset[0]) == encode_prompt(tok, render_chat(chat[0]["prompt"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FileTask(tok, chat)  # chat prompts: nothing to warn about
        FileTask(tok, rows, apply_chat_template="never")
    assert not [w for w in caught if "chat template" in str(w.message)]
    cfg = load_config(None, ["--data.train_files=[x.jsonl]", "--data.apply_chat_template=always"])
    assert cfg.task.args["apply_chat_template"] == "always"


def test_a_prompt_the_tokenizer_cannot_encode_is_named_at_build_not_mid_run(tmp_path):
    from hyperrl.data import DataError

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)] + [{"prompt": "é+1=", "answer": "x"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"train.jsonl:5: the prompt cannot be encoded \(TokenizerError"):
        FileTask(char_tokenizer(), str(data))


def test_prompt_plus_budget_beyond_the_models_context_is_refused_at_build(tmp_path):
    from hyperrl.config import ConfigError
    from tests.hf_fixtures import qwen3_checkpoint

    ck = qwen3_checkpoint(tmp_path / "ck", max_positions=64)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                                        "answer": str(i + 1)}) + "\n" for i in range(4)))
    over = [f"--model.checkpoint={ck}", f"--data.train_files=[{data}]", "--run.eval_every=0",
            f"--run.out_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=512 \+ the longest prompt \(\d+ tokens\) = \d+ "
                                          r"exceeds the model's context \(max_position_embeddings=64\); set "
                                          r"rollout.max_new_tokens ≤ \d+"):
        build_trainer(load_config(None, over))
    assert build_trainer(load_config(None, [*over, "--rollout.max_new_tokens=16"])).step_idx == 0
