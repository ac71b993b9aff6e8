"""Tokenizers and chat templates: the embedded character tokenizer as a transformers tokenizer,
the model's own tokenizer from a directory, and token-first multi-turn through a chat template
(the assistant → tool → assistant boundaries equal the template's rendering of the whole
conversation)."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperrl.envs import GSM8KCalculatorEnv, Limits, run_episodes
from hyperrl.envs.tools import TOOL_FORMATS, Tool, calculator_tool
from hyperrl.sampling import SamplingParams
from hyperrl.tokenizer import (
    DEFAULT_ALPHABET,
    TokenizerError,
    char_tokenizer,
    check_vocab,
    decode_response,
    encode_prompt,
    load_tokenizer,
    observation_ids,
)
from hyperrl.trajectory import stack_episodes
from tests.hf_fixtures import bpe_tokenizer

CHAR = char_tokenizer()
BPE = bpe_tokenizer()
TOOLS = [calculator_tool.spec()]


def test_char_tokenizer_keeps_the_embedded_ids():
    # 0 <pad>, 1 <bos>, 2 <eos>, then the alphabet: '3' is digit 3 → 6; '+' is alphabet index
    # 10 + 52 + 1 = 63 → 66; '=' is index 62 + 5 = 67 → 70. A string prompt gets <bos>.
    assert CHAR.encode("3+4=") == [1, 6, 66, 7, 70]
    assert (CHAR.pad_token_id, CHAR.bos_token_id, CHAR.eos_token_id, len(CHAR)) == (0, 1, 2, 3 + len(DEFAULT_ALPHABET))
    assert encode_prompt(CHAR, "3+4=") == [1, 6, 66, 7, 70]
    assert decode_response(CHAR, [6, 66, 7, 2, 0]) == "3+4"  # EOS and padding dropped


@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=40))
def test_char_tokenizer_round_trips_every_text_of_its_alphabet(text):
    ids = CHAR.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and decode_response(CHAR, ids) == text


def test_unknown_characters_are_an_error_not_dropped():
    with pytest.raises(TokenizerError, match="cannot be tokenised"):
        encode_prompt(CHAR, "3+4=é")


def test_char_tokenizer_saves_and_loads_as_an_auto_tokenizer(tmp_path):
    CHAR.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.encode("12+7=") == CHAR.encode("12+7=") and tok.chat_template == CHAR.chat_template


def test_chat_prompts_go_through_the_chat_template():
    ids = encode_prompt(CHAR, [{"role": "user", "content": "1+2="}])
    assert CHAR.decode(ids) == "<bos>user: 1+2=\nassistant: "
    ids = encode_prompt(BPE, [{"role": "user", "content": "What is 7 * 8?"}], tools=TOOLS)
    text = BPE.decode(ids)
    assert text.startswith("<|im_start|>system\n") and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n")


def test_a_message_prompt_needs_a_chat_template():
    tok = bpe_tokenizer()
    tok.chat_template = None
    with pytest.raises(TokenizerError, match="no chat_template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])


def test_model_chat_template_replaces_the_tokenizers_own(tmp_path, monkeypatch):
    """``model.chat_template``: Jinja text in the config, or a ``.jinja`` file (recorded absolute, so a
    resumed run finds it from any directory); a missing file or a syntax error fails at load naming the
    key; the built tokenizer renders with it (and saves it with itself)."""
    from hyperrl.config import ConfigError, load_config
    from hyperrl.models import build_tokenizer

    compact = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(compact + "#")
    monkeypatch.chdir(tmp_path)
    base = [f"--run.out_dir={tmp_path / 'run'}"]
    cfg = load_config(None, [*base, "--model.chat_template=t.jinja"])
    assert cfg.model.chat_template == str(tmp_path / "t.jinja")
    tok = build_tokenizer(cfg)
    assert tok.decode(encode_prompt(tok, [{"role": "user", "content": "1+2="}])) == "<bos>1+2=#"
    tok.save_pretrained(tmp_path / "tok")
    assert load_tokenizer(tmp_path / "tok").chat_template == compact + "#"
    with pytest.raises(ConfigError, match=r"model.chat_template: .*nope.jinja does not exist"):
        load_config(None, [*base, "--model.chat_template=nope.jinja"])
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ConfigError, match=r"model.chat_template: not a valid Jinja template \(line 1"):
        load_config(None, [*base, "--model.chat_template=bad.jinja"])
    assert build_tokenizer(load_config(None, base)).chat_template == CHAR.chat_template  # unset: the tokenizer's


def test_vocabulary_mismatch_names_both_sizes():
    with pytest.raises(TokenizerError, match=r"380 tokens but the model's vocabulary is 92"):
        check_vocab(BPE, 92, "model.checkpoint")
    check_vocab(BPE, 512)  # a model may pad its vocabulary up


def test_a_directory_without_a_tokenizer_is_an_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def _act(text: str) -> list[int]:
    return BPE.encode(text, add_special_tokens=False)


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'


def test_observation_ids_reproduce_the_template_of_the_whole_conversation():
    """user → assistant (tool call, stopped by <|im_end|>) → tool → assistant: the token-first
    sequence (prompt ids + sampled ids + observation ids + sampled ids) is exactly the
    template's tokenisation of the whole conversation — the "\\n" after <|im_end|>, which the
    policy never samples, is in the observation."""
    user = [{"role": "user", "content": "What is 7 * 8?"}]
    a1, a2 = _act(CALL + "<|im_end|>"), _act("The answer is 56.<|im_end|>")
    tool = [{"role": "tool", "name": "calculator", "content": "56"}]
    convo = [*user, {"role": "assistant", "content": CALL}]
    obs = observation_ids(BPE, convo, a1, tool, tools=TOOLS)
    ours = encode_prompt(BPE, user, tools=TOOLS) + a1 + obs + a2
    whole = [*convo, *tool, {"role": "assistant", "content": "The answer is 56."}]
    ref = BPE.apply_chat_template(whole, tools=TOOLS, tokenize=True, return_dict=False)
    assert ours == list(ref)[: len(ours)] and BPE.decode(list(ref)[len(ours):]) == "\n"
    assert BPE.decode(obs).startswith("\n<|im_start|>user\n<tool_response>\n56\n")


def test_an_action_cut_off_before_its_stop_token_gets_the_whole_closing():
    user = [{"role": "user", "content": "What is 7 * 8?"}]
    a1 = _act(CALL)  # max_new_tokens reached: no <|im_end|> sampled
    obs = observation_ids(BPE, [*user, {"role": "assistant", "content": CALL}], a1,
                          [{"role": "tool", "content": "56"}], tools=TOOLS)
    assert BPE.decode(obs).startswith("<|im_end|>\n<|im_start|>user\n")


class ScriptedEngine:
    """A stand-in policy that emits fixed texts turn by turn (what is under test is the episode's
    token assembly, not sampling): returns a trajectory like the real engines."""

    pad_id = 0
    policy_version = 3

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.calls = tok, turns, 0

    def generate(self, prompts, sampling, n=1, *, group_offset=0):
        ids = self.tok.encode(self.turns[self.calls], add_special_tokens=False)
        self.calls += 1
        rows = [dict(tokens=list(p) + ids, action=[False] * len(p) + [True] * len(ids),
                     logprobs=[0.0] * len(p) + [-0.5] * len(ids), reward=0.0, group_id=group_offset + i,
                     version=self.policy_version) for i, p in enumerate(prompts)]
        return stack_episodes(rows, self.pad_id)


def test_a_hermes_episode_is_token_first_and_matches_the_template():
    from hyperrl.data import Sample

    env = lambda: GSM8KCalculatorEnv(format="hermes")  # noqa: E731
    sample = Sample("What is 7 * 8?", "56", "t:0", {})
    eng = ScriptedEngine(BPE, [CALL + "<|im_end|>", "The answer is 56.<|im_end|>"])
    sp = SamplingParams(max_new_tokens=64, eos_id=BPE.eos_token_id, seed=0)
    batch, builders = run_episodes(eng, env, [sample], BPE, sp, limits=Limits(max_turns=3, max_obs_tokens=64,
                                                                                 max_episode_tokens=512))
    assert float(batch["reward"][0]) == 1.0  # "56" is the GSM8K answer of the final turn
    assert batch["tool_calls"].tolist() == [1]  # the calculator ran once (the tool-call rate's count)
    toks = batch["tokens"][0][batch["attention_mask"][0]].tolist()
    whole = [{"role": "user", "content": "What is 7 * 8?"}, {"role": "assistant", "content": CALL},
             {"role": "tool", "name": "calculator", "content": "56"},
             {"role": "assistant", "content": "The answer is 56."}]
    ref = list(BPE.apply_chat_template(whole, tools=TOOLS, tokenize=True, return_dict=False))
    assert toks == ref[: len(toks)] and BPE.decode(ref[len(toks):]) == "\n"
    # observation tokens carry action mask 0 and log-prob 0: never in the loss
    kinds = [k for k, _, _ in builders[0].segments]
    assert kinds == ["prompt", "action", "observation", "action"]
    _, s, e = builders[0].segments[2]
    assert not batch["action_mask"][0, s:e].any() and torch.all(batch["rollout_logprobs"][0, s:e] == 0)
    assert "<tool_response>" in BPE.decode(toks[s:e])


def test_tool_call_formats_parse_their_own_syntax():
    hermes, compact = TOOL_FORMATS.build("hermes")(), TOOL_FORMATS.build("hyperrl")()
    assert [json.loads(p)["name"] for p in hermes.parse(f"x {CALL} y")] == ["calculator"]
    assert compact.parse(CALL) == [] and compact.parse('<tool>{"name": "c"}</tool>') == ['{"name": "c"}']
    assert isinstance(compact.observation([]), str) and hermes.observation([]) == []


def test_tools_from_typed_python_functions():
    def multiply(a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return str(a * b)

    tool = Tool.from_function(multiply)
    assert tool.name == "multiply" and tool.schema["required"] == ["a", "b"]
    assert tool.schema["properties"]["a"]["type"] == "integer" and tool.schema["additionalProperties"] is False
    assert tool.spec()["function"]["description"] == "Multiply two integers."
