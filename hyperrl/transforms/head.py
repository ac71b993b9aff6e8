"""The LM head fused with the token log-prob and entropy: no ``[N, V]`` logits in either pass.

``head_logprobs_and_entropy(hidden [..., H], weight [V, H], tokens [...], T)`` is
``logprobs_and_entropy(hidden @ weightᵀ (+ bias), tokens, T)`` computed over chunks of rows: each chunk's
logits ``[c, V]`` are made, reduced to its rows' log-prob, entropy, ``logsumexp`` and ``E_p[z]`` and dropped.
Backward makes each chunk's logits again (one more ``c × H × V`` matmul) and turns them at once into the chunk's
gradient of the hidden states and its share of the weight's (and bias's), accumulated in fp32:

    z = (h Wᵀ + b) / T,  p = softmax(z),  lp = z_y − lse(z),  H = lse(z) − Σ p z
    ∂L/∂z = g_lp (onehot_y − p) − g_H p (z − E_p z),   ∂L/∂h = (∂L/∂z / T) W,   ∂L/∂W = (∂L/∂z / T)ᵀ h

(Liger-Kernel's fused linear cross-entropy and verl's ``use_fused_kernels`` make the same trade: time for the
``[B, T, V]`` logits and their gradient — at Qwen3's 151,936 tokens, 8 k positions: 5 GB each in fp32.)

Precision is the unfused path's: the matmul runs in ``compute_dtype`` (the autocast dtype the head would run in;
fp32 for an fp32 head, ``model.lm_head_fp32``), the log-softmax in fp32, the gradients of the logits are rounded
to ``compute_dtype`` before their matmuls as autograd would round them. With one chunk (a small vocabulary) the
values and gradients are the unfused path's bit for bit; with several, the weight's gradient is summed over
chunks in fp32 (or the weight's own dtype when wider).

:func:`head_divergence` does the same for a divergence between two whole next-token distributions (full-vocabulary
distillation: the student's head and the teacher's, each chunk's two log-softmaxes made, compared and dropped;
backward differentiates the divergence chunk by chunk, through the student only).
"""

from __future__ import annotations

import torch

from hyperrl.transforms.logprobs import CHUNK_ELEMENTS

__all__ = ["head_logprobs_and_entropy", "head_divergence"]


def _rows(chunk: int | None, vocab: int) -> int:
    return int(chunk) if chunk else max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float, masks) -> torch.Tensor:
    """The chunk's ``z = (h Wᵀ + b) / T`` in fp32 (``h``, ``w``, ``b`` already in the compute dtype), each mask's
    ids set to its value before the temperature."""
    z = torch.nn.functional.linear(h, w, b)
    for ids, value in masks:
        z.index_fill_(-1, ids, value)
    z = z.float() if z.dtype != torch.float32 else z
    return z.div_(temperature) if temperature != 1.0 else z


class _HeadGrads:
    """The gradients of the head's inputs — hidden states ``[N, H]``, weight, bias — filled chunk by chunk from
    each chunk's gradient of ``z`` (both fused kernels' backward): ``∂L/∂logits = ∂L/∂z / T`` rounded to the
    logits' dtype (as autograd rounds it), 0 at masked ids (constants), then ``(∂L/∂logits) W`` for the chunk's
    rows and ``(∂L/∂logits)ᵀ h`` summed over chunks in fp32 (or the weight's dtype when wider)."""

    def __init__(self, needs, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype, masks,
                 temperature: float):
        need_h, need_w, need_b = needs[:3]
        self.acc = acc = torch.promote_types(weight.dtype, torch.float32)
        self.h, self.weight, self.bias, self.dtype, self.masks, self.T = h, weight, bias, dtype, masks, temperature
        self.w = weight.to(dtype)
        self.g_h = torch.empty_like(h) if need_h else None
        self.g_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_w else None
        self.g_b = torch.zeros(weight.shape[0], dtype=acc, device=h.device) if need_b else None

    def add(self, s: int, gz: torch.Tensor, hc: torch.Tensor) -> None:
        """Rows ``s … s + len(gz)``: ``gz`` the chunk's fp32 gradient of ``z`` (consumed), ``hc`` its hidden
        states in the compute dtype."""
        gz = gz.div_(self.T).to(self.dtype)
        for ids, _ in self.masks:  # a masked logit is a constant: nothing flows back through it
            gz.index_fill_(-1, ids, 0)
        if self.g_h is not None:
            self.g_h[s:s + len(gz)] = (gz @ self.w).to(self.h.dtype)
        if self.g_w is not None:
            self.g_w.add_((gz.t() @ hc).to(self.acc))
        if self.g_b is not None:
            self.g_b.add_(gz.to(self.acc).sum(0))

    def result(self, hidden: torch.Tensor) -> tuple:
        """``(∂L/∂hidden, ∂L/∂weight, ∂L/∂bias)`` in their inputs' shapes and dtypes (None where not needed)."""
        return (None if self.g_h is None else self.g_h.view_as(hidden),
                None if self.g_w is None else self.g_w.to(self.weight.dtype),
                None if self.g_b is None else self.g_b.to(self.bias.dtype))


class _HeadLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk, want_entropy, dtype, masks):
        H, V = hidden.shape[-1], weight.shape[0]
        h, tok = hidden.reshape(-1, H), tokens.reshape(-1)
        n = h.shape[0]
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ez = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        rows = _rows(chunk, V)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for s in range(0, n, rows):
                z = _logits(h[s:s + rows].to(dtype), w, b, temperature, masks)
                m = torch.logsumexp(z, -1, keepdim=True)
                lse[s:s + rows] = m[:, 0]
                lp[s:s + rows] = (z.gather(-1, tok[s:s + rows, None]) - m)[:, 0]
                if want_entropy:
                    ez[s:s + rows] = torch.linalg.vecdot(torch.sub(z, m).exp_(), z)
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, ez)
        ctx.args = (temperature, chunk, want_entropy, dtype, masks)
        ent = (lse - ez) if want_entropy else ez
        return lp.view(tokens.shape), ent.view(tokens.shape) if want_entropy else ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, tokens, lse, ez = ctx.saved_tensors
        T, chunk, want_entropy, dtype, masks = ctx.args
        H, V = hidden.shape[-1], weight.shape[0]
        h, tok = hidden.reshape(-1, H), tokens.reshape(-1)
        g_lp = torch.zeros(tok.shape, device=h.device) if g_lp is None else g_lp.reshape(-1)
        use_ent = want_entropy and g_ent is not None
        g_ent = g_ent.reshape(-1) if use_ent else None
        grads = _HeadGrads(ctx.needs_input_grad, h, weight, bias, dtype, masks, T)
        w, b = grads.w, None if bias is None else bias.to(dtype)
        rows = _rows(chunk, V)
        with torch.autocast(device_type=h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                hc = h[s:s + rows].to(dtype)
                z = _logits(hc, w, b, T, masks)
                p = torch.sub(z, lse[s:s + rows, None]).exp_()
                gl = g_lp[s:s + rows, None]
                if use_ent:  # z ← g_H (z − E z) + g_lp ; ∂L/∂z = −p z + g_lp onehot
                    z.sub_(ez[s:s + rows, None]).mul_(g_ent[s:s + rows, None]).add_(gl)
                    gz = p.mul_(z).neg_()
                else:
                    gz = p.mul_(-gl)
                gz.scatter_add_(-1, tok[s:s + rows, None], gl)
                grads.add(s, gz, hc)
        return (*grads.result(hidden), None, None, None, None, None, None)


def head_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                              temperature: float = 1.0, *, bias: torch.Tensor | None = None,
                              compute_dtype: torch.dtype | None = None, want_entropy: bool = True,
                              chunk_size: int | None = None, masks=()) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax((hidden Wᵀ + b) / T)[tokens]`` and the entropy there, fp32 ``[...]`` each, never
    materialising the ``[..., V]`` logits (module doc). ``hidden [..., H]``, ``weight [V, H]`` (the head's; a tied
    embedding's), ``tokens [...]`` the ids each position's distribution produced; ``compute_dtype``: the matmul's
    (default: the autocast dtype when autocast is on, else ``hidden``'s); ``chunk_size``: rows per chunk (default
    ≈ 32 M logits); ``want_entropy=False``: the entropy is an empty tensor and its work is skipped; ``masks``:
    ``(ids, value)`` pairs — those logits set to ``value`` before the temperature (a head's output mask,
    :func:`hyperrl.multimodal.suppress_outputs`), constants for the gradient."""
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"hidden {list(hidden.shape)} must be tokens {list(tokens.shape)} + [H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {list(weight.shape)} must be [V, H={hidden.shape[-1]}]")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {list(bias.shape)} must be [V={weight.shape[0]}]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (greedy decoding has no log-probs to train on)")
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    masks = tuple((torch.as_tensor(ids, dtype=torch.long, device=hidden.device), float(v)) for ids, v in masks)
    return _HeadLogprobEntropy.apply(hidden, weight, bias, tokens, float(temperature), chunk_size, want_entropy,
                                     compute_dtype, masks)


class _HeadDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher, temperature, chunk, dtype, masks, divergence):
        H, V = hidden.shape[-1], weight.shape[0]
        h = hidden.reshape(-1, H)
        th, tw, tb, tdtype, tmasks = teacher
        th = th.reshape(h.shape[0], -1)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        tw, tb = tw.to(tdtype), None if tb is None else tb.to(tdtype)
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        rows = _rows(chunk, V)
        with torch.autocast(device_type=h.device.type, enabled=False), torch.no_grad():
            for s in range(0, h.shape[0], rows):
                zs = _logits(h[s:s + rows].to(dtype), w, b, temperature, masks).log_softmax(-1)
                zt = _logits(th[s:s + rows].to(tdtype), tw, tb, temperature, tmasks).log_softmax(-1)
                out[s:s + rows] = divergence(zs, zt)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.teacher, ctx.args = (th, tw, tb, tdtype, tmasks), (temperature, chunk, dtype, masks, divergence)
        return out.view(hidden.shape[:-1])

    @staticmethod
    def backward(ctx, g):
        hidden, weight, bias = ctx.saved_tensors
        th, tw, tb, tdtype, tmasks = ctx.teacher
        T, chunk, dtype, masks, divergence = ctx.args
        H, V = hidden.shape[-1], weight.shape[0]
        h, g = hidden.reshape(-1, H), g.reshape(-1)
        grads = _HeadGrads(ctx.needs_input_grad, h, weight, bias, dtype, masks, T)
        w, b = grads.w, None if bias is None else bias.to(dtype)
        rows = _rows(chunk, V)
        with torch.autocast(device_type=h.device.type, enabled=False):
            for s in range(0, h.shape[0], rows):
                hc = h[s:s + rows].to(dtype)
                with torch.no_grad():
                    zt = _logits(th[s:s + rows].to(tdtype), tw, tb, T, tmasks).log_softmax(-1)
                    z = _logits(hc, w, b, T, masks)
                z.requires_grad_()
                with torch.enable_grad():  # the divergence's own gradient, one chunk at a time
                    gz, = torch.autograd.grad(divergence(z.log_softmax(-1), zt), z, g[s:s + rows])
                grads.add(s, gz, hc)
        return (*grads.result(hidden), None, None, None, None, None, None)


def head_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                    teacher_weight: torch.Tensor, divergence, temperature: float = 1.0, *,
                    bias: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
                    compute_dtype: torch.dtype | None = None, teacher_dtype: torch.dtype | None = None,
                    masks=(), teacher_masks=(), chunk_size: int | None = None) -> torch.Tensor:
    """``divergence(log softmax(z_s), log softmax(z_t))`` per position ``[...]`` fp32, ``z = (h Wᵀ + b) / T`` of the
    student (``hidden [..., H]``, ``weight [V, H]``) and of the teacher (``teacher_hidden [..., H_t]``,
    ``teacher_weight [V, H_t]``: one vocabulary), never materialising either ``[..., V]`` distribution (module doc).
    ``divergence(s [c, V], t [c, V]) → [c]``: e.g. ``lambda s, t: full_vocab_jsd(s, t, β)``; its gradient flows
    into the student's hidden states and head only. ``compute_dtype`` / ``teacher_dtype``, ``masks`` /
    ``teacher_masks``, ``chunk_size``: as :func:`head_logprobs_and_entropy`'s, for each side."""
    if teacher_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"teacher_hidden {list(teacher_hidden.shape)} must be hidden {list(hidden.shape[:-1])} + "
                         "[H_t] (the same positions)")
    if teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher vocabulary {teacher_weight.shape[0]} differs from the student's {weight.shape[0]} "
                         "(full-vocabulary distillation needs one vocabulary)")
    for name, h, w in (("weight", hidden, weight), ("teacher_weight", teacher_hidden, teacher_weight)):
        if w.dim() != 2 or w.shape[1] != h.shape[-1]:
            raise ValueError(f"{name} {list(w.shape)} must be [V, H={h.shape[-1]}]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    dev = hidden.device.type
    auto = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    compute_dtype = compute_dtype or auto or hidden.dtype
    teacher_dtype = teacher_dtype or auto or teacher_hidden.dtype

    def _m(ms):
        return tuple((torch.as_tensor(i, dtype=torch.long, device=hidden.device), float(v)) for i, v in ms)

    teacher = (teacher_hidden.detach(), teacher_weight.detach(),
               None if teacher_bias is None else teacher_bias.detach(), teacher_dtype, _m(teacher_masks))
    return _HeadDivergence.apply(hidden, weight, bias, teacher, float(temperature), chunk_size, compute_dtype,
                                 _m(masks), divergence)
