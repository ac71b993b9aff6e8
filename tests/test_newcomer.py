"""A newcomer's first real run, through the CLI as they would type it: their own Qwen-style
checkpoint (byte-level BPE tokenizer, ChatML template, two stop ids in ``generation_config`` like a
real Qwen3), verl-format parquet, a TRL-style and a verl-style reward from a file — then the export,
loaded back with transformers, stopping where the source model stops; and a LoRA run's adapters
exported alone, loaded by PEFT."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import resign
from tests.hf_fixtures import qwen3_checkpoint

ROOT = Path(__file__).resolve().parents[1]

REWARDS = '''
def accuracy(prompts, completions, completion_ids, answer, **kw):  # TRL style
    return [float(c[0]["content"].strip().startswith(str(a))) for c, a in zip(completions, answer)]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # verl style
    return {"score": float(str(ground_truth) in solution_str), "length": len(solution_str)}
'''


def _parquet(path: Path, pairs) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}} for i, (a, b) in enumerate(pairs)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _cli(*args, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hyperrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


class _Force:
    """A logits processor forcing ``token`` at generation step ``at`` (0-based) and forbidding the
    stop ids before it."""

    def __init__(self, prompt_len: int, token: int, at: int, stops):
        self.prompt_len, self.token, self.at, self.stops = prompt_len, token, at, list(stops)

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        scores = scores.clone()
        if step == self.at:
            scores[:, :] = float("-inf")
            scores[:, self.token] = 0.0
        else:
            scores[:, self.stops] = float("-inf")
        return scores


def _stops_at(model, tok, token: int, at: int = 2) -> int:
    """How many tokens ``model.generate`` (its own generation config) produces when ``token`` is
    forced at step ``at`` — ``at + 1`` when the model's generation config stops at it."""
    from transformers import LogitsProcessorList

    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False,
                         logits_processor=LogitsProcessorList([_Force(ids.shape[1], token, at, [0, 2])]))
    return out.shape[1] - ids.shape[1]


@pytest.mark.slow
def test_a_newcomers_first_run_trains_exports_and_stops_where_the_source_stops(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    me = tmp_path / "me"
    me.mkdir()
    qwen3_checkpoint(me / "my-qwen", two_stops=True)  # generation_config eos_token_id [2, 0]
    _parquet(me / "train.parquet", [(a, b) for a in range(1, 5) for b in range(1, 4)])
    _parquet(me / "val.parquet", [(7, 1), (8, 1)])
    (me / "my_rewards.py").write_text(REWARDS)
    res = _cli("train", "--model.checkpoint=my-qwen", "--data.train_files=[train.parquet]",
               "--data.val_files=[val.parquet]",
               "--rewards=[{fn: my_rewards.py:accuracy, style: trl}, {fn: my_rewards.py:compute_score, style: verl}]",
               "--run.steps=2", "--rollout.prompts_per_step=2", "--rollout.n=2", "--run.eval_every=2",
               "--run.eval_prompts=2", "--run.threads=2", cwd=me)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    (run,) = list((me / "runs").iterdir())  # its own directory, named from the config — not runs/default
    assert run.name.startswith("files-")
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["rollout"]["max_new_tokens"] == 512 and cfg["optim"]["lr"] == 1e-6  # the defaults that fit
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r["event"] == "step"][-1]
    assert {"reward_accuracy_mean", "reward_compute_score_mean", "response_clipped_frac",
            "reward_compute_score_length_mean"} <= set(step)
    assert step["response_len_mean"] > 3  # not cut to the toy task's 3 tokens
    # the export keeps both stop ids, and generation stops at either — where the source model stops
    src, hf = AutoModelForCausalLM.from_pretrained(me / "my-qwen"), AutoModelForCausalLM.from_pretrained(run / "hf")
    tok = AutoTokenizer.from_pretrained(run / "hf")
    assert hf.generation_config.eos_token_id == [2, 0]
    for token in (2, 0):  # <|im_end|>, <|endoftext|>
        assert _stops_at(hf, tok, token) == _stops_at(src, tok, token) == 3, token
    # `hyperrl export` from another directory, with a relative checkpoint path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ck = os.path.relpath(run / "checkpoints" / "step_2", elsewhere)
    res = _cli("export", ck, "exp", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert AutoModelForCausalLM.from_pretrained(elsewhere / "exp").generation_config.eos_token_id == [2, 0]
    # a run recorded with a path relative to its directory still exports; a missing one is named, exit 2
    state = run / "checkpoints" / "step_2" / "state.json"
    st = json.loads(state.read_text())
    st["config"]["model"]["checkpoint"] = os.path.relpath(me / "my-qwen", run)
    state.write_text(json.dumps(st))
    resign(state.parent, "state.json")  # an edit on purpose (an older run's record), signed
    assert _cli("export", ck, "exp2", cwd=elsewhere).returncode == 0
    st["config"]["model"]["checkpoint"] = str(tmp_path / "gone")
    state.write_text(json.dumps(st))
    resign(state.parent, "state.json")
    bad = _cli("export", ck, "exp3", cwd=elsewhere)
    assert bad.returncode == 2 and "model.checkpoint" in bad.stderr and "gone does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_lora_runs_adapters_export_alone_and_peft_loads_them_to_the_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.export import ExportError, export_hf

    ck = qwen3_checkpoint(tmp_path / "ck", two_stops=True)
    _parquet(tmp_path / "train.parquet", [(1, 2), (3, 4)])
    cfg = load_config(None, [f"--model.checkpoint={ck}", f"--data.train_files=[{tmp_path / 'train.parquet'}]",
                             "--model.lora={r: 4, alpha: 8}", "--optim.lr=0.05", "--rollout.prompts_per_step=2",
                             "--rollout.n=2", "--rollout.max_new_tokens=4", "--run.eval_every=0",
                             f"--run.out_dir={tmp_path / 'run'}", "--run.threads=1"])
    tr = build_trainer(cfg)
    tr.step()
    step = tr.save()
    merged = AutoModelForCausalLM.from_pretrained(export_hf(step, tmp_path / "merged"))
    ad = export_hf(step, tmp_path / "adapters", adapters=True)
    assert (ad / "adapter_config.json").is_file() and (ad / "adapter_model.safetensors").is_file()
    assert not (ad / "model.safetensors").exists()  # the adapters alone
    assert json.loads((ad / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ck), ad).eval()
    base = AutoModelForCausalLM.from_pretrained(ck).eval()
    ids = torch.tensor([[5, 9, 14, 30, 2]])
    with torch.no_grad():
        got, want, before = peft(ids).logits, merged(ids).logits, base(ids).logits
    assert (want - before).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # PEFT over the base = the merged export
    full = load_config(None, [f"--model.checkpoint={ck}", f"--data.train_files=[{tmp_path / 'train.parquet'}]",
                              "--rollout.prompts_per_step=2", "--rollout.n=2", "--rollout.max_new_tokens=4",
                              "--run.eval_every=0", f"--run.out_dir={tmp_path / 'full'}", "--run.threads=1"])
    with pytest.raises(ExportError, match="--adapters exports a LoRA run's adapters"):
        export_hf(build_trainer(full).save(), tmp_path / "x", adapters=True)
