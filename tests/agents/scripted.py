"""A scripted policy for the agent tests: the engine, the gateway, the client, the tokenizer and the
chat template are real; the model's *choices* are written down, because a model from random weights
never writes a well-formed tool call. :class:`ScriptedLM` is a ``torch.nn.Module`` the
:class:`~hyperrl.rollout.TransformersEngine` drives like a transformers model — prefill, then decode
over a ``DynamicCache`` (here holding the token ids themselves, so the whole context is known at every
step, through the engine's batch repeats and row drops) — and puts all but e^-60 of the probability on
``script(context_ids)``."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class ScriptedLM(torch.nn.Module):
    def __init__(self, vocab_size: int, script):
        super().__init__()
        self.vocab_size, self.script = vocab_size, script
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # one parameter: the engine's publication has a name
        self.config = SimpleNamespace(max_position_embeddings=4096, vocab_size=vocab_size)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=1, **kw):
        from transformers import DynamicCache

        cache = past_key_values if past_key_values is not None else DynamicCache()
        x = input_ids.double()[:, None, :, None]
        k, _ = cache.update(x, x, 0)
        ctx = k[:, 0, :, 0].long()
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(ctx, dtype=torch.bool)
        logits = torch.full((ctx.shape[0], 1, self.vocab_size), -30.0)
        for b in range(ctx.shape[0]):
            logits[b, 0, self.script(ctx[b][mask[b][-ctx.shape[1]:]].tolist())] = 30.0
        return SimpleNamespace(logits=logits, past_key_values=cache)


def hermes_script(tok, call_text: str, answer_ids: list[int]):
    """Call the tool (``call_text`` as the BPE encodes it) on the first turn; once a tool response is in
    the context, answer with ``answer_ids`` (chosen by the test: e.g. one id per character, which
    re-tokenising the text would merge); every turn ends with ``<|im_end|>``."""
    gen = tok.encode("<|im_start|>assistant\n")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = tok.encode(call_text) + [end]
    answer = list(answer_ids) + [end]
    response = tok.encode("<tool_response>")

    def script(ctx: list[int]) -> int:
        starts = [i + len(gen) for i in range(len(ctx) - len(gen) + 1) if ctx[i:i + len(gen)] == gen]
        emitted = ctx[starts[-1]:] if starts else []
        target = answer if any(ctx[i:i + len(response)] == response for i in range(len(ctx))) else call
        return target[len(emitted)] if len(emitted) < len(target) else end

    return script
