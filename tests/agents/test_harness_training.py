"""The real coding-agent CLIs trained by ``hyperrl train`` (issue 51, item 7): Codex and Claude Code, installed by
.ci/run from agents-cli/, run as ``env: {name: agent, harness: …}`` for a few steps of the real command with a tiny
random Qwen3 whose context holds their own prompts (Codex sends ≈ 28 k characters, Claude Code ≈ 49 k: ≈ 8 k and
15 k tokens of the byte-level BPE the test trains on the repository's docs and sources, 8,192 ids). The policy's
answers are random text; what is asserted is the plumbing a real run needs: the CLI exits 0 in every episode, the
gateway refused nothing and failed nothing, each row is token-exact — the text the CLI printed is the decoding of
the sampled ids ``completions.jsonl`` holds — a judge scored every episode, and the update ran on those rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.agents.test_harnesses import clis  # noqa: F401 - the pinned CLIs, installed once (npm ci)

pytestmark = [pytest.mark.xdist_group("agent_clis"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
JUDGE = '''
import json, os
def judge(sample, result):
    """Log what the CLI printed; score its answer's length (a variance GRPO can use)."""
    said = json.loads(result.stdout)["result"] if result.stdout.lstrip().startswith("{") else result.stdout
    with open(os.environ["JUDGE_LOG"], "a") as f:
        f.write(json.dumps({"said": said, "exit_code": result.exit_code, "stderr": result.stderr[-500:]}) + "\\n")
    return min(len(said.strip()), 20) / 20 if result.exit_code == 0 else 0.0
'''


def stops_soon(model, eos: int, p: float = 0.25, big: float = 100.0) -> None:
    """Make a random model end its answer with probability ≈ ``p`` at every token (Codex fails an answer cut off at
    the token cap — as it should — and a uniform policy over 8,192 ids rarely stops). Every embedding gets a large
    constant first coordinate, so after the final RMSNorm that coordinate is ≈ √hidden whatever the context; the
    untied head reads it only in EOS's row: logit(EOS) ≈ ln(p / (1 − p) · (V − 1)), every other logit ≈ 0."""
    import math

    import torch

    with torch.no_grad():
        head = model.get_input_embeddings().weight.detach().clone()
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
        model.get_input_embeddings().weight[:, 0] = big
        target = math.log(p / (1 - p) * (head.shape[0] - 1))
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = target / math.sqrt(model.config.hidden_size)


def _checkpoint(path: Path) -> Path:
    """A 1-layer random Qwen3 with a 32 k context and a byte-level BPE of 8,192 ids trained on docs/*.md and the
    package's sources (English and code, as the CLIs' prompts are), ChatML with tools listed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hyperrl.models.tiny import tiny_qwen3
    from tests.hf_fixtures import CHATML_TOOLS

    files = sorted(ROOT.glob("docs/*.md")) + sorted((ROOT / "hyperrl").rglob("*.py"))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator((f.read_text() for f in files), trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TOOLS
    model = tiny_qwen3(len(tok), hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, intermediate=64, seed=0,
                       pad_id=tok.pad_token_id, bos_id=None, eos_id=tok.eos_token_id, max_positions=32768)
    stops_soon(model, tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("harness", ["codex", "claude_code"])
def test_the_real_cli_trains_through_hyperrl_train(harness, tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    (tmp_path / "judge.py").write_text(JUDGE)
    log, out = tmp_path / "judge.jsonl", tmp_path / "run"
    steps, n = 2, 2
    cmd = [sys.executable, "-m", "hyperrl.cli", "train", f"--model.checkpoint={ckpt}",
           "--task.name=products", "--env.name=agent", f"--env.harness={harness}",
           f"--env.reward={tmp_path}/judge.py:judge", "--env.timeout_s=240", "--rollout.prompts_per_step=1",
           f"--rollout.n={n}", "--rollout.max_new_tokens=32", "--rollout.max_episode_tokens=32000",
           f"--run.steps={steps}", "--run.eval_every=0",
           "--run.log_completions=64", f"--run.out_dir={out}", "--run.export=false", "--run.threads=1",
           "--optim.lr=0.01"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "JUDGE_LOG": str(log)})
    assert r.returncode == 0, r.stderr[-3000:]
    judged = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(judged) == steps * n and all(j["exit_code"] == 0 for j in judged), judged
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_rows = [m for m in rows if m["event"] == "step"]
    assert len(step_rows) == steps
    for m in step_rows:  # every episode ran, nothing failed or was refused
        assert m["agent_episodes"] == n and m["agent_failed"] == 0 and m["agent_empty"] == 0, m
        assert m["agent_server_errors"] == 0 and m["agent_refused_requests"] == 0, m
        # one call an episode, except that Claude Code answers an empty turn by rewriting its last user message
        # ("[Your previous response had no visible output. …]" appended) and asking again: a real CLI's context
        # rewrite — a row of its own, counted
        assert m["agent_rows"] == m["agent_calls"] == n + m["agent_rewrites"], m
        assert m["agent_rewrites"] == 0 or harness == "claude_code", m
    # token-exact: what each CLI printed is the decoding (decode_response) of the ids the gateway sampled — every
    # answer with text ended its episode, so those are exactly the rows' non-empty completions
    done = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(done) == sum(m["agent_rows"] for m in step_rows)
    said = Counter(j["said"].strip() for j in judged if j["said"].strip())
    assert said == Counter(c["completion"].strip() for c in done if c["completion"].strip()), (judged, done)
    assert {round(c["reward"], 6) for c in done if c["completion"].strip()} == {round(min(len(t), 20) / 20, 6)
                                                                                 for t in said}
    assert any(j["said"].strip() for j in judged), judged  # some answer had text (p(EOS) = 0.25 a token)
    assert [m["policy_version"] for m in step_rows] == list(range(1, steps + 1))  # each update published
    assert step_rows[0]["grad_norm"] > 0 and step_rows[0]["mismatch_max_abs"] < 1e-4, step_rows[0]
