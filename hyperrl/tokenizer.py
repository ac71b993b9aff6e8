"""Tokenizers and chat templates: one code path for the embedded default and real models.

Every tokenizer the loop sees is a ``transformers`` tokenizer: a model's own ``AutoTokenizer``
(:func:`load_tokenizer`, a local directory) or :func:`char_tokenizer`, the CPU default built in
code — a ``PreTrainedTokenizerFast`` with one id per character (0 = ``<pad>``, 1 = ``<bos>``,
2 = ``<eos>``, then the alphabet), a ``<bos>`` post-processor and a small chat template. The
loop reads ``eos_token_id`` / ``pad_token_id`` and special tokens from the tokenizer, never
constants.

Prompts (:func:`encode_prompt`): a string is tokenised as is (with the tokenizer's own special
tokens, e.g. ``<bos>``); a message list goes through ``apply_chat_template(...,
add_generation_prompt=True)`` with the tools' schemas. Multi-turn observations
(:func:`observation_ids`) are the chat template's own tokens between the policy's last action
and the next generation prompt — computed from the template, appended as ids, and the policy's
sampled ids are never re-tokenised.
"""

from __future__ import annotations

import string
from pathlib import Path

from hyperrl.errors import HyperRLError

__all__ = ["TOKENIZER_FILES", "DEFAULT_ALPHABET", "CHAR_CHAT_TEMPLATE", "char_tokenizer", "load_tokenizer",
           "read_chat_template", "is_template_file",
           "encode_prompt", "encode_text", "decode_response", "decode_responses", "check_vocab", "observation_ids",
           "TokenizerError"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")  # any one of them

DEFAULT_ALPHABET = string.digits + string.ascii_letters + " +-*/=()?.,:;#$%<>[]{}_'\"!\n"

# ``role: content`` lines (what hyperrl rendered before templates); the generation prompt is
# ``assistant: ``; a turn ends with the policy's ``<eos>`` and a newline.
CHAR_CHAT_TEMPLATE = (  # newlines as expressions: chat templates render with trim_blocks
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


class TokenizerError(HyperRLError, ValueError):
    """A tokenizer that cannot serve the run (missing files, vocabulary mismatch, no template)."""


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET, specials: tuple[str, ...] = ()):
    """The embedded character tokenizer as a ``PreTrainedTokenizerFast`` (``tokenizers``
    WordLevel over single characters; a character outside ``alphabet`` is an error, never dropped).
    ``specials``: whole-string special tokens after the alphabet (e.g. a vision-language model's
    ``<|image_pad|>``), matched in text before it is split into characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if len(set(alphabet)) != len(alphabet):
        raise ValueError("alphabet: characters must be unique")
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    vocab.update({t: len(vocab) + i for i, t in enumerate(specials)})
    core = Tokenizer(models.WordLevel(vocab))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                        special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = CHAR_CHAT_TEMPLATE
    return tok


def load_tokenizer(path: str | Path):
    """The model's own tokenizer from a local directory (``AutoTokenizer``). A tokenizer without a
    pad token pads with its EOS (padding is masked everywhere; documented choice)."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir() or not any((p / f).exists() for f in TOKENIZER_FILES):
        raise TokenizerError(f"{p}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer with "
                             "tokenizer.save_pretrained(dir) or set model.tokenizer to its directory")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError) as e:  # a corrupt config.json / tokenizer.json: one line, named
        first = (str(e).strip().splitlines() or [""])[0]
        raise TokenizerError(f"{p}: the tokenizer cannot be loaded ({type(e).__name__}: {first[:300]})") from None
    if tok.eos_token_id is None:
        raise TokenizerError(f"{p}: the tokenizer has no eos_token; generation could never stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def is_template_file(spec: str) -> bool:
    """``model.chat_template`` names a file (a path ending ``.jinja``) rather than holding the Jinja text."""
    return spec.endswith(".jinja")


def read_chat_template(spec: str) -> str:
    """``model.chat_template``: Jinja text, or a path to a ``.jinja`` file (read) → the template text,
    parsed once so a syntax error is reported at config load (``ValueError`` naming the key and line),
    not at the first rendering."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = spec
    if is_template_file(spec):
        p = Path(spec)
        if not p.is_file():
            raise ValueError(f"model.chat_template: {spec} does not exist (a path ending .jinja is read as a file)")
        text = p.read_text()
    try:  # transformers renders templates in this environment (trim_blocks, lstrip_blocks, loop controls)
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"model.chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


def _ids(out) -> list[int]:
    """``apply_chat_template`` returns a list (transformers 4) or a BatchEncoding (5)."""
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def encode_text(tok, text: str, *, special: bool = False) -> list[int]:
    """``text`` → ids (no special tokens unless ``special``); an untokenisable text names itself."""
    try:
        return list(tok.encode(text, add_special_tokens=special))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for unknown symbols
        vocab = tok.get_vocab()
        missing = sorted({c for c in text if c not in vocab}) if all(len(k) == 1 for k in vocab if "<" not in k) \
            else []
        hint = f" (characters not in its vocabulary: {''.join(missing)!r}; model.alphabet sets the embedded " \
               "tokenizer's)" if missing else ""
        raise TokenizerError(f"text {text[:60]!r} cannot be tokenised: {e}{hint}") from None


def encode_prompt(tok, prompt: str | list, *, tools: list | None = None) -> list[int]:
    """A prompt's ids: a string with the tokenizer's special tokens (``<bos>`` …); a message list
    ``[{role, content}]`` through the chat template with the generation prompt (and ``tools``)."""
    if isinstance(prompt, str):
        return encode_text(tok, prompt, special=True)
    if not getattr(tok, "chat_template", None):
        raise TokenizerError("prompt is a message list but the tokenizer has no chat_template; give the "
                             "tokenizer a template (tokenizer.chat_template = ...) or use string prompts")
    kw = {"tools": tools} if tools else {}
    return _ids(tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, **kw))


def decode_response(tok, ids, stops=()) -> str:
    """The text a reward or an environment reads: stop tokens (``eos_token_id`` and ``stops``: a
    turn's end) and the padding after one dropped; every other token rendered — a special token
    the policy sampled mid-answer stays visible. (``skip_special_tokens=True``, what verl and TRL
    decode with, hides it: a policy learns to pad ``"8<pad>5"`` into the reward's ``"85"``.)"""
    return decode_responses(tok, [ids], stops)[0]


def decode_responses(tok, rows, stops=()) -> list[str]:
    """:func:`decode_response` of every row of ``rows`` (lists of ids), the stop set read once and the rows
    decoded in one batch (a fast tokenizer decodes them in Rust)."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    stop = {int(i) for i in stops} | ({eos} if eos is not None else set())
    kept = []
    for ids in rows:
        keep, ended = [], False
        for i in ids:
            i = int(i)
            if i in stop or (ended and i == pad):
                ended = True
                continue
            keep.append(i)
            ended = False
        kept.append(keep)
    if not kept:
        return []
    if hasattr(tok, "batch_decode"):
        return tok.batch_decode(kept, skip_special_tokens=False)
    return [tok.decode(k, skip_special_tokens=False) for k in kept]


def check_vocab(tok, model_vocab: int, where: str = "model") -> None:
    """Every tokenizer id must index the model's embedding (models may pad their vocabulary up)."""
    if len(tok) > model_vocab:
        raise TokenizerError(f"{where}: the tokenizer has {len(tok)} tokens but the model's vocabulary is "
                             f"{model_vocab}; use the model's own tokenizer (model.tokenizer) or a model whose "
                             "vocab_size covers it")


_SENTINEL = "\u2063HYPERRL_TURN\u2063"


def _render(tok, messages, tools, gen: bool) -> str:
    kw = {"tools": tools} if tools else {}
    return tok.apply_chat_template(list(messages), add_generation_prompt=gen, tokenize=False, **kw)


def observation_ids(tok, messages: list, action_ids: list[int], new_messages: list, *,
                    tools: list | None = None) -> list[int]:
    """The ids the chat template places after the policy's action ``action_ids`` (the assistant
    turn closing ``messages``) and before the next generation: the rest of the assistant turn's
    closing (e.g. ChatML's newline after ``<|im_end|>``, which the policy never samples, or the
    whole ``<|im_end|>\\n`` when it was cut off), ``new_messages`` (tool results) and the next
    generation prompt. Tokenising ``render(all) − render(before)`` once keeps the separators at
    turn boundaries (a known peer bug drops them). ``messages`` ends with that assistant message."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("messages: must end with the assistant message the action produced")
    base = _render(tok, messages, tools, gen=False)
    full = _render(tok, [*messages, *new_messages], tools, gen=True)
    if not full.startswith(base):
        raise TokenizerError("the chat template is not prefix-stable (rendering more messages changes earlier "
                             "text); token-first multi-turn needs one that is")
    # the closing of a plain assistant turn (a message with structured tool calls renders them after its content;
    # the policy's sampled ids already hold its calls in its own format)
    probe = _render(tok, [*messages[:-1], {"role": "assistant", "content": _SENTINEL}], tools, gen=False)
    closing = probe[probe.rindex(_SENTINEL) + len(_SENTINEL):]  # e.g. "<|im_end|>\n"
    # the stop token the policy sampled (EOS, or e.g. <|im_end|>) is already in the context
    last = tok.convert_ids_to_tokens(int(action_ids[-1])) if action_ids else None
    stopped = last is not None and int(action_ids[-1]) in tok.all_special_ids and closing.startswith(last)
    missing = closing[len(last):] if stopped else closing
    return encode_text(tok, missing + full[len(base):])
