"""A researcher's first run, end to end on CPU: a local HF-format Qwen3 checkpoint with its own
byte-level BPE tokenizer and chat template (written by the test), chat prompts from data files,
a TRL-style reward from a file, a validation file, completion logs, checkpoint retention and an
export that transformers loads back — plus the data and evaluation pieces one by one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.data import DataError, PromptDataset
from hyperrl.data.tasks import FileTask
from hyperrl.tokenizer import char_tokenizer
from tests.hf_fixtures import qwen3_checkpoint

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [(a, b) for a in range(1, 6) for b in range(1, 5)]


def _rows(pairs):
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b),
             "data_source": "sums"} for a, b in pairs]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REWARD_FILE = '''
def starts_with_answer(prompts, completions, completion_ids, answer, **kw):
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)  # chat prompts
    return [float(c[0]["content"].strip().startswith(a)) for c, a in zip(completions, answer)]

def has_digit(prompts, completions, **kw):
    return [float(any(ch.isdigit() for ch in c[0]["content"])) for c in completions]
'''


@pytest.mark.slow
def test_a_local_checkpoint_trains_from_the_cli_and_exports(tmp_path):
    ckpt = qwen3_checkpoint(tmp_path / "qwen3", seed=1)
    train = _jsonl(tmp_path / "train.jsonl", _rows(QUESTIONS[:16]))
    val = _jsonl(tmp_path / "val.jsonl", _rows(QUESTIONS[16:]))
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    out = tmp_path / "run"
    (tmp_path / "run.yaml").write_text(f"""
model: {{checkpoint: {ckpt}}}
data: {{train_files: [{train}], val_files: [{val}], max_prompt_length: 64}}
rewards:
  - {{fn: "{tmp_path / 'my_rewards.py'}:starts_with_answer", style: trl}}
  - {{fn: "{tmp_path / 'my_rewards.py'}:has_digit", style: trl, weight: 0.1}}
rollout: {{prompts_per_step: 4, n: 4, max_new_tokens: 6}}
optim: {{lr: 0.003}}
run: {{steps: 6, eval_every: 3, eval_prompts: 4, eval_n: 2, log_completions: 2, ckpt_every: 2, keep_last_k: 2,
       out_dir: {out}, threads: 1}}
""")
    res = subprocess.run([sys.executable, "-m", "hyperrl.cli", "train", "--config", str(tmp_path / "run.yaml")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [r for r in rows if r["event"] == "step"], [r for r in rows if r["event"] == "eval"]
    assert len(steps) == 6 and [e["step"] for e in evals] == [0, 3, 6]
    assert {"reward_starts_with_answer_mean", "reward_has_digit_mean"} <= set(steps[-1])
    assert evals[-1]["eval_n"] == 2 and evals[-1]["eval_pass_at_k"] >= evals[-1]["eval_reward_mean"] - 1e-9
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 12 and {r["step"] for r in logged} == set(range(1, 7))
    assert logged[0]["prompt"].startswith("user\nWhat is")  # rendered by the chat template (specials dropped)
    assert {"completion", "advantage", "reward_starts_with_answer", "reward_has_digit"} <= set(logged[0])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4", "step_6"]  # keep_last_k = 2
    # the export loads with transformers and holds the trained weights, with the run's tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hyperrl.loop.checkpoint import consolidate

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    trained = consolidate(out / "checkpoints" / "step_6")
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in trained.items())
    init = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert any(not torch.equal(sd[k], init[k]) for k in trained)  # it trained
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert tok.encode("What is 3 + 4?") == AutoTokenizer.from_pretrained(ckpt).encode("What is 3 + 4?")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # and `hyperrl export` writes the same from any checkpoint
    res = subprocess.run([sys.executable, "-m", "hyperrl.cli", "export", str(out / "checkpoints" / "step_4"),
                          str(tmp_path / "exp4")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    sd4 = AutoModelForCausalLM.from_pretrained(tmp_path / "exp4").state_dict()
    assert all(torch.equal(sd4[k], v) for k, v in consolidate(out / "checkpoints" / "step_4").items())


def test_bad_data_is_named_before_anything_is_written(tmp_path):
    ckpt = qwen3_checkpoint(tmp_path / "qwen3")
    train = _jsonl(tmp_path / "train.jsonl", _rows(QUESTIONS))
    bad_val = _jsonl(tmp_path / "val.jsonl", [{"question": "no prompt column", "answer": "1"}])
    base = [f"--model.checkpoint={ckpt}", f"--data.train_files=[{train}]", f"--run.out_dir={tmp_path / 'out'}"]
    with pytest.raises(DataError, match=r"val.jsonl: column 'prompt' missing \(columns: \['answer', 'question'\]\)"):
        build_trainer(load_config(None, [*base, f"--data.val_files=[{bad_val}]"]))
    from hyperrl.run import train

    with pytest.raises(DataError, match=r"train.jsonl:0: prompt of \d+ tokens > data.max_prompt_length=5"):
        train(load_config(None, [*base, "--data.max_prompt_length=5", "--run.eval_every=0"]), progress=False)
    assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(ConfigError, match="data.train_files and task are both set"):
        load_config(None, [*base, "--task=modsum"])


def test_overlong_prompts_filtered_or_truncated_to_their_last_tokens(tmp_path):
    tok = char_tokenizer()
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "12345+67890=", "answer": "80235"}]
    f = FileTask(tok, rows, rows, max_prompt_length=6, overlong_prompts="filter")
    assert len(f.dataset) == 1 and f.filtered == 2  # once in train, once in val
    t = FileTask(tok, rows, None, max_prompt_length=6, overlong_prompts="truncate")
    long = t.dataset[1]
    assert t.encode(long) == tok.encode("12345+67890=")[-6:]  # the end (the question's tail) kept


def test_files_parquet_jsonl_json_records_and_hf_datasets_read_alike(tmp_path):
    import datasets

    rows = [{"prompt": "1+1=", "answer": "2", "data_source": "x"}, {"prompt": "2+2=", "answer": "4"}]
    _jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    got = [PromptDataset.from_files(tmp_path / f"a.{ext}") for ext in ("jsonl", "json", "parquet")]
    got.append(PromptDataset.from_records(datasets.Dataset.from_list(rows)))
    got.append(PromptDataset.from_records(rows))
    for ds in got:
        assert [(s.prompt, s.answer) for s in ds.samples] == [("1+1=", "2"), ("2+2=", "4")]
    with pytest.raises(DataError, match=r"a.csv: unsupported data file type"):
        (tmp_path / "a.csv").write_text("prompt\n")
        PromptDataset.from_files(tmp_path / "a.csv")


def test_evaluation_uses_validation_rows_never_training_rows(tmp_path):
    tok = char_tokenizer()
    train = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(5)]
    val = [{"prompt": "8+8=", "answer": "16"}]
    t = FileTask(tok, train, val)
    assert [s.prompt for s in t.held_out(10)] == ["8+8="]
    with pytest.raises(ValueError, match="evaluation needs validation data: set data.val_files"):
        FileTask(tok, train).held_out(4)


def test_multi_turn_evaluation_runs_the_environment(tmp_path):
    from hyperrl.envs import ENVIRONMENTS, StepResult

    calls = []

    class Counting:
        def reset(self, sample):
            return sample.prompt

        def step(self, action):
            calls.append(action)
            return StepResult("", 0.25, True)

    ENVIRONMENTS.add("counting_test_env", lambda: Counting())
    try:
        cfg = load_config(None, ["--env=counting_test_env", f"--run.out_dir={tmp_path}",
                                 "--rollout.prompts_per_step=4", "--rollout.n=2", "--model.hidden=32",
                                 "--model.intermediate=64", "--run.eval_prompts=3", "--run.eval_n=2"])
        tr = build_trainer(cfg)
        m = tr.evaluate()
    finally:
        ENVIRONMENTS._items.pop("counting_test_env", None)
    assert len(calls) == 6 and m["eval_reward_mean"] == 0.25 and m["eval_pass_at_k"] == 0.25
