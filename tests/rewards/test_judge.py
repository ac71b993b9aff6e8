"""A judge model as a reward (issue 50, item 4): a tiny local judge built here — its prompt rendered from the row
with the judge's own chat template, batched with left padding, equal to asking it one row at a time — and a
scripted OpenAI-compatible judge endpoint; unparseable verdicts abstain; a missing tokenizer, chat template or
template file is named."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hyperrl.config.schema import RewardSpec
from hyperrl.data import Sample
from hyperrl.rewards import RewardError, build_rewards
from hyperrl.rewards.judge import parse_verdict
from tests.hf_fixtures import qwen3_checkpoint

TEMPLATE = "Question: {{ prompt }}\nAnswer: {{ completion }}\nReference: {{ answer }}\nScore 0-9:"
ROWS = [Sample("2+2=", "4", "a", {}), Sample("3+4=", "7", "b", {}), Sample("1+1=", "2", "c", {})]
TEXTS = ["4", "it is 8", "2, I think", "no idea"]
SAMPLES = [ROWS[0], ROWS[1], ROWS[2], ROWS[0]]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A judge that always answers digits: its final norm keeps only dimension 0 of the hidden state, and the head
    reads that dimension into "7" (positive) or "3" (negative) — every other token's logit is 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = qwen3_checkpoint(tmp_path_factory.mktemp("judge") / "judge", seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path)
    seven, three = tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("3")
    lm.config.tie_word_embeddings = False  # its own head (the embeddings stay as they are)
    lm.lm_head.weight = torch.nn.Parameter(lm.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        lm.model.norm.weight.zero_()
        lm.model.norm.weight[0] = 1.0
        lm.lm_head.weight[:, 0] = 0.0
        lm.lm_head.weight[seven, 0], lm.lm_head.weight[three, 0] = 50.0, -50.0
    lm.save_pretrained(path)
    back = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(back.lm_head.weight, lm.lm_head.weight)
    assert back.lm_head.weight is not back.model.embed_tokens.weight
    return path


def _one_by_one(path, prompts: list[str]) -> list[float]:
    """The judge asked one row at a time, without padding, straight through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for q in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = lm.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(float(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)[0]))
    return out


def test_a_local_judge_scores_as_asked_one_row_at_a_time(judge_dir, tmp_path):
    tmpl = tmp_path / "judge.jinja"
    tmpl.write_text(TEMPLATE)
    rs = build_rewards([RewardSpec(judge={"model": str(judge_dir), "template": str(tmpl), "pattern": r"(\d)",
                                          "max_new_tokens": 3, "batch_size": 3}, workers=2)])
    comps, app, _ = rs.score([s.prompt for s in SAMPLES], TEXTS, [[1]] * 4, SAMPLES)
    prompts = [TEMPLATE.replace("{{ prompt }}", s.prompt).replace("{{ completion }}", t)
               .replace("{{ answer }}", s.answer) for s, t in zip(SAMPLES, TEXTS)]
    assert comps[:, 0].tolist() == _one_by_one(judge_dir, prompts) and app.all()
    assert set(comps[:, 0].tolist()) <= {3.0, 7.0}
    rs.close()
    # a verdict that is not there: every row abstains (not applicable), none scored 0
    rs = build_rewards([RewardSpec(judge={"model": str(judge_dir), "template": TEMPLATE, "pattern": r"score=(\d+)",
                                          "max_new_tokens": 3})])
    comps, app, _ = rs.score([s.prompt for s in SAMPLES], TEXTS, [[1]] * 4, SAMPLES)
    assert not app.any()


def test_a_judge_without_tokenizer_chat_template_or_template_file_is_named(judge_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(judge_dir, bare)
    (bare / "tokenizer_config.json").write_text((bare / "tokenizer_config.json").read_text()
                                                .replace('"chat_template"', '"unused_template"'))
    for f in ("chat_template.jinja",):
        (bare / f).unlink(missing_ok=True)
    with pytest.raises(RewardError, match=r"judge.model: .*bare's tokenizer has no chat template"):
        build_rewards([RewardSpec(judge={"model": str(bare), "template": TEMPLATE})])
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(RewardError, match=r"judge.model: .*bare has no tokenizer the judge can read"):
        build_rewards([RewardSpec(judge={"model": str(bare), "template": TEMPLATE})])
    with pytest.raises(RewardError, match=r"judge.template: .*missing.jinja does not exist"):
        build_rewards([RewardSpec(judge={"model": str(judge_dir), "template": str(tmp_path / "missing.jinja")})])
    with pytest.raises(RewardError, match=r"judge: give one of model .* and url"):
        build_rewards([RewardSpec(judge={"template": TEMPLATE})])
    rs = build_rewards([RewardSpec(judge={"model": str(judge_dir), "template": "{{ nothing_here }}"})])
    with pytest.raises(RewardError, match=r"judge.template: UndefinedError: 'nothing_here' is undefined"):
        rs.score(["q"], ["a"], [[1]], ROWS[:1])


def test_a_scripted_judge_endpoint_parses_json_verdicts_and_abstains_on_hedges(tmp_path):
    port_file = tmp_path / "port"
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("reward_server.py")), str(port_file)])
    try:
        deadline = time.time() + 20
        while not port_file.exists():
            assert time.time() < deadline and server.poll() is None
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}/v1"
        rs = build_rewards([RewardSpec(judge={"url": url, "template": "Is this {{ completion }}?", "parse": "json"},
                                       workers=3, name="judge")])
        comps, app, _ = rs.score(["q"] * 3, ["right", "wrong", "maybe"], [[1]] * 3, ROWS)
        assert comps[:, 0].tolist() == [1.0, 0.0, 0.0] and app[:, 0].tolist() == [True, True, False]
        rs.close()
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("text, parse, want", [
    ("Score: 7/10", "regex", 7.0), ("score -2.5 then 3", "regex", -2.5), ("none", "regex", None),
    ('x {"score": 0.5} {"score": 1}', "json", 0.5), ('{"other": 1} {"score": true}', "json", 1.0),
    ("{not json}", "json", None), ('{"score": "high"}', "json", None),
    ('{"verdict": {"why": "a } in text", "score": 0.25}}', "json", 0.25),  # a nested object that has it
    ('{"why": "a } here", "score": 0.75}', "json", 0.75), ('{"score": NaN}', "json", None),
    ("score inf", "regex", None)])
def test_verdicts_parse_or_abstain(text, parse, want):
    assert parse_verdict(text, parse, r"([-+]?\d+(?:\.\d+)?)", "score") == want
