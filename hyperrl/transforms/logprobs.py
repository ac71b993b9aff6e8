"""Token log-probs and entropy from logits, in fp32 chunks: no fp32 ``[B, T, V]`` copy.

Both are custom autograd functions that keep only the (low-precision) logits for backward and
recompute each chunk's softmax there, so peak extra memory is ``chunk_size × V`` fp32 plus the
``[B, T, V]`` gradient in the logits' own dtype.

Alignment: ``token_logprobs(logits, tokens)`` expects ``logits[..., t, :]`` to be the
distribution that produced ``tokens[..., t]``. Model logits predict the *next* token; use
:func:`sequence_logprobs` to shift them into the trajectory convention.
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "entropy", "sequence_logprobs", "naive_token_logprobs"]

DEFAULT_CHUNK = 1024


class _TokenLogprob(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(logits, tokens, temperature, chunk):
        flat = logits.reshape(-1, logits.shape[-1])
        tok = tokens.reshape(-1)
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s : s + chunk].float() / temperature
            out[s : s + chunk] = z.gather(-1, tok[s : s + chunk, None])[:, 0] - torch.logsumexp(z, -1)
        return out.view(tokens.shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, tokens, temperature, chunk = inputs
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.chunk = temperature, chunk

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.shape[-1])
        tok, g = tokens.reshape(-1), grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            p = torch.softmax(flat[s : s + chunk].float() / T, -1)
            onehot = torch.zeros_like(p).scatter_(-1, tok[s : s + chunk, None], 1.0)
            grad[s : s + chunk] = ((onehot - p) * (g[s : s + chunk, None] / T)).to(grad.dtype)
        return grad.view_as(logits), None, None, None


class _Entropy(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(logits, temperature, chunk):
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s : s + chunk].float() / temperature
            p = torch.softmax(z, -1)
            out[s : s + chunk] = torch.logsumexp(z, -1) - (p * z).sum(-1)
        return out.view(logits.shape[:-1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, temperature, chunk = inputs
        ctx.save_for_backward(logits)
        ctx.temperature, ctx.chunk = temperature, chunk

    @staticmethod
    def backward(ctx, grad_out):
        (logits,) = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            z = flat[s : s + chunk].float() / T
            p = torch.softmax(z, -1)
            ez = (p * z).sum(-1, keepdim=True)
            # dH/dz_k = −p_k (z_k − E_p[z]); chain rule through z = logits / T
            grad[s : s + chunk] = (-p * (z - ez) * (g[s : s + chunk, None] / T)).to(grad.dtype)
        return grad.view_as(logits), None, None


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """``log softmax(logits / temperature)[tokens]`` in fp32. ``[..., V], [...] → [...]`` fp32.

    The temperature is the one the rollout sampled with, so these are the log-probs of the
    distribution actually sampled from.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {list(logits.shape)} must be tokens {list(tokens.shape)} + [V]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs to train on)")
    return _TokenLogprob.apply(logits, tokens, float(temperature), int(chunk_size))


def entropy(logits: torch.Tensor, temperature: float = 1.0, *, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) − Σ softmax(z)·z`` of ``z = logits/temperature``. ``[..., V] → [...]``."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    return _Entropy.apply(logits, float(temperature), int(chunk_size))


def sequence_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, **kw) -> torch.Tensor:
    """Model logits ``[B, T, V]`` (``logits[:, t]`` predicts ``t+1``) → token-aligned log-probs
    ``[B, T]`` with ``out[:, t] = log π(tokens[:, t] | tokens[:, :t])`` and ``out[:, 0] = 0``."""
    lp = token_logprobs(logits[:, :-1], tokens[:, 1:], temperature, **kw)
    return torch.nn.functional.pad(lp, (1, 0))


def naive_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reference path: a full fp32 ``log_softmax`` (materialises ``[B, T, V]`` fp32)."""
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]
