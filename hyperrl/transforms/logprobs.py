"""Token log-probs and entropy from logits, in fp32 chunks: no fp32 ``[B, T, V]`` copy.

These are custom autograd functions that keep only the (low-precision) logits for backward and
recompute each chunk's softmax there, so the peak extra memory is a few ``chunk × V`` fp32
buffers (``chunk_size=None`` picks ≈ 32 M elements per chunk) plus the ``[B, T, V]`` gradient in
the logits' own dtype. ``logprobs_and_entropy`` computes both from one pass and one backward.

Alignment: ``token_logprobs(logits, tokens)`` expects ``logits[..., t, :]`` to be the
distribution that produced ``tokens[..., t]``. Model logits predict the *next* token; use
:func:`sequence_logprobs` to shift them into the trajectory convention.
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "entropy", "logprobs_and_entropy", "sequence_logprobs", "naive_token_logprobs"]

CHUNK_ELEMENTS = 1 << 25  # ≈ 32 M fp32 elements (128 MiB) per chunk buffer


def _rows(chunk: int | None, vocab: int) -> int:
    return int(chunk) if chunk else max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _fp32(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh fp32 copy of ``chunk / temperature`` (never a view of the caller's logits)."""
    z = chunk.float() if chunk.dtype != torch.float32 else chunk.clone()
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_stats(z: torch.Tensor, want_entropy: bool):
    """In-place on the fp32 chunk ``z``: returns (lse, p or None, E_p[z] or None); z survives."""
    lse = torch.logsumexp(z, -1, keepdim=True)
    if not want_entropy:
        return lse, None, None
    p = torch.sub(z, lse).exp_()
    ez = torch.linalg.vecdot(p, z).unsqueeze(-1)
    return lse, p, ez


class _LogprobEntropy(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(logits, tokens, temperature, chunk, want_entropy):
        V = logits.shape[-1]
        flat, tok = logits.reshape(-1, V), tokens.reshape(-1)
        n = flat.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=logits.device)
        rows = _rows(chunk, V)
        # fp32 whatever the caller's autocast: under bf16 autocast the entropy's Σ p·z (vecdot) ran in bf16 —
        # 0.02 nats off at a 50-token vocabulary
        with torch.autocast(device_type=logits.device.type, enabled=False):
            for s in range(0, n, rows):
                z = _fp32(flat[s : s + rows], temperature)
                lse, _, ez = _chunk_stats(z, want_entropy)
                lp[s : s + rows] = (z.gather(-1, tok[s : s + rows, None]) - lse)[:, 0]
                if want_entropy:
                    ent[s : s + rows] = (lse - ez)[:, 0]
        return lp.view(tokens.shape), ent.view(tokens.shape) if want_entropy else ent

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, tokens, temperature, chunk, want_entropy = inputs
        ctx.save_for_backward(logits, tokens)
        ctx.args = (temperature, chunk, want_entropy)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, tokens = ctx.saved_tensors
        T, chunk, want_entropy = ctx.args
        V = logits.shape[-1]
        flat, tok = logits.reshape(-1, V), tokens.reshape(-1)
        g_lp = torch.zeros(tok.shape, device=logits.device) if g_lp is None else g_lp.reshape(-1)
        use_ent = want_entropy and g_ent is not None
        g_ent = g_ent.reshape(-1) if use_ent else None
        grad = torch.empty_like(flat)
        rows = _rows(chunk, V)
        with torch.autocast(device_type=logits.device.type, enabled=False):  # a backward run inside autocast
            for s in range(0, flat.shape[0], rows):
                z = _fp32(flat[s : s + rows], T)
                lse, p, ez = _chunk_stats(z, True)
                gl = g_lp[s : s + rows, None]
                # d lp / dz = onehot − p ;  d H / dz = −p (z − E_p[z]) ; chain rule through z = logits / T
                if use_ent:
                    z.sub_(ez).mul_(g_ent[s : s + rows, None]).add_(gl)  # z ← g_H (z − E z) + g_lp
                    out = p.mul_(z).neg_()
                else:
                    out = p.mul_(-gl)
                out.scatter_add_(-1, tok[s : s + rows, None], gl)
                grad[s : s + rows] = out.div_(T)
        return grad.view_as(logits), None, None, None, None


def _check(logits, tokens, temperature):
    if tokens is not None and logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {list(logits.shape)} must be tokens {list(tokens.shape)} + [V]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs to train on)")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                   chunk_size: int | None = None) -> torch.Tensor:
    """``log softmax(logits / temperature)[tokens]`` in fp32. ``[..., V], [...] → [...]`` fp32.

    The temperature is the one the rollout sampled with, so these are the log-probs of the
    distribution actually sampled from.
    """
    _check(logits, tokens, temperature)
    return _LogprobEntropy.apply(logits, tokens, float(temperature), chunk_size, False)[0]


def logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                         chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both token log-probs and entropies ``[...]`` fp32 from one chunked pass (one backward)."""
    _check(logits, tokens, temperature)
    return _LogprobEntropy.apply(logits, tokens, float(temperature), chunk_size, True)


def entropy(logits: torch.Tensor, temperature: float = 1.0, *, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) − Σ softmax(z)·z`` of ``z = logits/temperature``. ``[..., V] → [...]``."""
    _check(logits, None, temperature)
    tokens = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return _LogprobEntropy.apply(logits, tokens, float(temperature), chunk_size, True)[1]


def sequence_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, **kw) -> torch.Tensor:
    """Model logits ``[B, T, V]`` (``logits[:, t]`` predicts ``t+1``) → token-aligned log-probs
    ``[B, T]`` with ``out[:, t] = log π(tokens[:, t] | tokens[:, :t])`` and ``out[:, 0] = 0``."""
    lp = token_logprobs(logits[:, :-1], tokens[:, 1:], temperature, **kw)
    return torch.nn.functional.pad(lp, (1, 0))


def naive_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reference path: a full fp32 ``log_softmax`` (materialises ``[B, T, V]`` fp32)."""
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]
