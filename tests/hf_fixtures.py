"""Real Hugging Face artefacts built by the tests themselves (no downloads): a byte-level BPE
tokenizer trained by ``tokenizers`` on a tiny corpus with a ChatML chat template that lists tools
(Hermes / Qwen2.5 style), and a small Qwen3 checkpoint directory holding it."""

from __future__ import annotations

from pathlib import Path

# ChatML with Hermes tool calling, the shape of Qwen2.5's template (simplified): tools listed in a
# system turn, a tool result as a user turn wrapped in <tool_response>, turns closed by <|im_end|>\n.
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>"
    "{{ '\\n' }}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "What is 12 + 30? The answer is 42.", "Compute 7 * 8 with the calculator: 56.",
    '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>',
    "<tool_response>\n56\n</tool_response>", "The sum of 3 and 4 is 7. #### 7",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
] * 20


def bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials and :data:`CHATML_TOOLS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TOOLS
    return tok


def qwen3_checkpoint(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                     two_stops: bool = False, zero_norm: bool = False, max_positions: int = 2048) -> Path:
    """Save a random-initialised Qwen3 sized to :func:`bpe_tokenizer` and that tokenizer to ``path``.
    ``two_stops``: its ``generation_config`` lists both ``<|im_end|>`` and ``<|endoftext|>`` (as a
    real Qwen3's does; the tokenizer's EOS is only the first). ``zero_norm``: the final norm's
    weight is 0, so every logit is 0 and greedy decoding emits token 0 (``<|endoftext|>``) — a model
    that stops at once exactly when 0 is among its stop ids."""
    import torch

    from hyperrl.models.tiny import tiny_qwen3

    path = Path(path)
    tok = bpe_tokenizer()
    model = tiny_qwen3(len(tok), hidden=hidden, layers=layers, heads=2, kv_heads=1, head_dim=32,
                       intermediate=2 * hidden, seed=seed, pad_id=tok.pad_token_id, bos_id=None,
                       eos_id=tok.eos_token_id, max_positions=max_positions)
    if two_stops:
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    if zero_norm:
        with torch.no_grad():
            model.model.norm.weight.zero_()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
