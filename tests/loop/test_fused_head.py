"""The fused LM head in the trainer's forwards (issue 54, item 1): every forward path and every model family hyperrl
trains — dense, MoE, a vision-language model (its output mask included), LoRA, an fp32 head on a bf16 forward —
gives the unfused path's log-probs, entropies and parameter gradients, and runs its head on no position."""

import numpy as np
import pytest
import torch
from PIL import Image

from hyperrl.loop.forward import (
    choose,
    packed_logprobs_and_entropy,
    plain_logprobs_and_entropy,
    shared_prefix_logprobs_and_entropy,
)
from hyperrl.models import tiny_qwen2_5_vl, tiny_qwen3, tiny_qwen3_moe
from hyperrl.models.head import fp32_lm_head, fusable_head, head_skipped, head_weights, use_fused_head
from hyperrl.models.lora import apply_lora
from hyperrl.multimodal import expand_placeholders, suppress_outputs, vision_spec
from hyperrl.rollout.hf import TransformersEngine
from hyperrl.sampling import SamplingParams
from tests.loop.test_forward import _batch

V = 40


def _rows():
    """Four rows: two share a prompt, one is multi-turn (an observation between two actions)."""
    return _batch([([1, 5, 6], [([9, 3, 2], True)]), ([1, 5, 6], [([4, 2], True)]),
                   ([1, 7], [([8, 8], True), ([11, 12], False), ([13, 2], True)]), ([1, 9, 9, 9], [([3], True)])])


def _compare(model, batch, forward, *, tol=1e-10, amp=False):
    """(lp, ent, grads) fused and unfused on ``batch``'s action positions: equal within ``tol``."""
    act = batch["action_mask"]
    params = [p for p in model.parameters() if p.requires_grad]
    w = torch.randn(act.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = []
    for fused in (True, False):
        calls, head = [], model.get_output_embeddings()
        own = head.__dict__.get("forward")  # an fp32 head's
        run = own or type(head).forward.__get__(head)
        head.forward = lambda x, run=run, calls=calls: calls.append(x.shape) or run(x)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                lp, ent = forward(model, batch, 0.9, fused=fused)
        finally:
            if own is None:
                del head.forward
            else:
                head.forward = own
        assert bool(calls) != fused, calls  # fused: the head's projection never ran
        loss = ((lp.double() + 0.1 * ent.double()) * w * act).sum()
        out.append((lp[act].detach(), ent[act].detach(), torch.autograd.grad(loss, params)))
    (lp1, e1, g1), (lp0, e0, g0) = out
    torch.testing.assert_close(lp1, lp0, atol=tol, rtol=tol)
    torch.testing.assert_close(e1, e0, atol=tol, rtol=tol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    return out


def _plain(model, batch, temp, fused):
    return plain_logprobs_and_entropy(model, batch, temp, fused=fused)


def _shared(model, batch, temp, fused):
    return shared_prefix_logprobs_and_entropy(model, batch, temp, fused=fused)


def _packed(model, batch, temp, fused):
    return packed_logprobs_and_entropy(model, batch, temp, 6, fused=fused)


@pytest.mark.parametrize("forward", [_plain, _shared, _packed])
@pytest.mark.parametrize("tied", [True, False])
def test_a_dense_model_every_forward_path(forward, tied):
    model = tiny_qwen3(V, seed=3, dtype=torch.float64)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    _compare(model, _rows(), forward)


def test_a_mixture_of_experts():
    """float32 (the experts' grouped matmul has no float64 kernel): equal to fp32 rounding."""
    _compare(tiny_qwen3_moe(V, seed=4), _rows(), _plain, tol=1e-5)
    _compare(tiny_qwen3_moe(V, seed=4), _rows(), _shared, tol=1e-5)


def test_lora_adapters_and_a_trained_head():
    """PEFT-wrapped: the adapters' gradients (and the head's, trained in place) are the unfused path's."""
    model = apply_lora(tiny_qwen3(V, seed=5, dtype=torch.float64), r=4, alpha=8, dropout=0.0,
                       target_modules=["q_proj", "v_proj"], train_modules=["lm_head"])
    for n, p in model.named_parameters():
        if "lora_B" in n:  # B = 0 at init: move it, or the adapters would carry no gradient to compare
            torch.nn.init.normal_(p, std=0.1)
    assert fusable_head(model) is None
    _compare(model, _rows(), _shared)


def test_an_fp32_head_on_a_bf16_forward():
    """model.lm_head_fp32 under bf16 autocast: the fused head computes its matmul in fp32 as the patched head does
    (values to fp32 rounding; the fp32 head's own forward is back in place after)."""
    model = fp32_lm_head(tiny_qwen3(V, seed=6))
    own = model.lm_head.__dict__["forward"]
    assert head_weights(model).dtype == torch.float32
    _compare(model, _rows(), _plain, tol=2e-5, amp=True)
    assert model.lm_head.__dict__["forward"] is own


def _image(h, w, seed):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def test_a_vision_language_model_with_its_output_mask():
    """Qwen2.5-VL: images and M-RoPE positions as the engine made them, the vision special tokens' logits masked
    at the head (a forward hook the fused head applies itself) — equal values and gradients, mask included."""
    from transformers import Qwen2VLImageProcessorPil

    Vv, IMG, VS, VE, VID = 64, 60, 61, 62, 63
    model = tiny_qwen2_5_vl(Vv, image_token_id=IMG, vision_start_id=VS, vision_end_id=VE, video_token_id=VID,
                            dtype=torch.float64)
    suppress_outputs(model, vision_spec(model).input_only)
    assert fusable_head(model) is None and len(head_weights(model).masks) == 1
    o = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)(images=[_image(56, 56, 0)],
                                                                                   return_tensors="pt")
    ids = expand_placeholders([1, VS, IMG, VE, 5, 7], IMG, o["image_grid_thw"])
    batch = TransformersEngine(model).generate([ids, [1, 5, 6, 7]], SamplingParams(max_new_tokens=5, seed=3, eos_id=2),
                                               n=2, vision=[(o["pixel_values"].double(), o["image_grid_thw"]), None])
    assert choose(batch)[0]
    _compare(model, batch, _plain)
    _compare(model, batch, _shared)


def test_what_cannot_be_fused_is_named_and_runs_unfused():
    model = tiny_qwen3(V)
    assert use_fused_head("on", model) and not use_fused_head("off", model)
    assert not use_fused_head("auto", model)  # 40 tokens: the small vocabulary keeps the unfused path's bits
    assert use_fused_head("auto", tiny_qwen3(8192, hidden=16, head_dim=8, intermediate=16))
    h = model.lm_head.register_forward_hook(lambda m, a, out: out * 2)
    assert "a hook that is not an output mask" in fusable_head(model)
    with pytest.warns(RuntimeWarning, match="optim.fused_head=on: Qwen3ForCausalLM runs its head unfused"):
        assert not use_fused_head("on", model)
    h.remove()
    model.config.model_type = "gemma2"  # soft-caps its logits after the head
    assert "'gemma2' is not one whose logits are its head's output alone" in fusable_head(model)
    untied = tiny_qwen3(V)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    lora_head = apply_lora(untied, r=2, alpha=2, dropout=0.0, target_modules=["lm_head"])
    assert "not a Linear layer" in fusable_head(lora_head) and not use_fused_head("auto", lora_head)


def test_the_head_is_back_after_an_error_inside():
    model = tiny_qwen3(V)
    hook = suppress_outputs(model, (3,))
    with pytest.raises(RuntimeError, match="boom"), head_skipped(model):
        raise RuntimeError("boom")
    assert "forward" not in model.lm_head.__dict__ and hook.id in model.lm_head._forward_hooks
    logits = model(input_ids=torch.tensor([[1, 5]])).logits
    assert logits.shape[-1] == V and float(logits[0, -1, 3].detach()) == -1e4


def test_the_trainer_fused_and_unfused(tmp_path):
    """Two steps of the default job with optim.fused_head on and off: the same rollouts, losses, gradient norms
    and weights to float rounding (the reference and old-policy forwards run fused too)."""
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    runs = []
    for mode in ("on", "off"):
        tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path / mode}", "--run.eval_every=0",
                                              "--rollout.prompts_per_step=4", "--rollout.n=4", "--algo.kl.coef=0.01",
                                              f"--optim.fused_head={mode}"]))
        try:
            runs.append(([tr.step() for _ in range(2)], [p.detach().clone() for p in tr.policy.parameters()]))
        finally:
            tr.close()
    (ma, wa), (mb, wb) = runs
    for a, b in zip(ma, mb):
        for k in ("loss_policy", "grad_norm", "entropy_mean", "mismatch_mean_abs"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    # AdamW divides by √v: a gradient entry near 0 moves its weight by up to lr either way — 4e-6 seen
    assert all(torch.allclose(x, y, atol=2e-5) for x, y in zip(wa, wb))
