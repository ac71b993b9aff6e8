"""A vision-language policy through the transformers engine and the trainer's forwards (issue 32, items 2 and 5):
the rollout's log-probs equal the trainer's recomputation on the same multimodal rows — plain and shared-prefix
forwards, ``generate`` and ``generate_requests`` — because both compute M-RoPE positions in one place
(``hyperrl.multimodal.rope_positions``); the vision special tokens are never sampled; two prompts with the same
placeholder tokens but different images are never merged by the shared-prefix forward."""

import numpy as np
import pytest
import torch
from PIL import Image

from hyperrl.loop.forward import choose, plain_logprobs_and_entropy, prefix_groups, shared_prefix_logprobs_and_entropy
from hyperrl.models import tiny_qwen2_5_vl, tiny_qwen3
from hyperrl.multimodal import VisionError, expand_placeholders, suppress_outputs, vision_spec
from hyperrl.rollout.hf import TransformersEngine
from hyperrl.rollout.requests import Request
from hyperrl.sampling import SamplingParams

V, IMG, VS, VE, VID = 64, 60, 61, 62, 63


def _image(h: int, w: int, seed: int):
    g = np.random.default_rng(seed)
    return Image.fromarray((g.random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vlm():
    model = tiny_qwen2_5_vl(V, image_token_id=IMG, vision_start_id=VS, vision_end_id=VE, video_token_id=VID)
    suppress_outputs(model, vision_spec(model).input_only)
    return model


@pytest.fixture(scope="module")
def prompts():
    """Four prompts: one image, a taller one, none, two images (the last ends on its second image)."""
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    out, vis = [], []
    for r, imgs in enumerate([[(56, 56)], [(84, 56)], [], [(56, 56), (56, 84)]]):
        if not imgs:
            out.append([1, 5, 6, 7, 8, 9])
            vis.append(None)
            continue
        o = proc(images=[_image(h, w, 10 * r + i) for i, (h, w) in enumerate(imgs)], return_tensors="pt")
        body = [t for _ in imgs for t in (VS, IMG, VE)]
        text = [] if r == 3 else [5 + r, 7]
        out.append(expand_placeholders([1, *text, *body[:-1]] if r == 3 else [1, *body, *text], IMG,
                                       o["image_grid_thw"]))
        vis.append((o["pixel_values"], o["image_grid_thw"]))
    return out, vis


def _gaps(model, batch):
    act = batch["action_mask"]
    with torch.no_grad():
        plain, _ = plain_logprobs_and_entropy(model, batch, 1.0)
        use, _, groups = choose(batch)
        shared, _ = shared_prefix_logprobs_and_entropy(model, batch, 1.0, groups)
    ref = batch["rollout_logprobs"]
    return use, float((plain - ref)[act].abs().max()), float((shared - ref)[act].abs().max())


def test_rollout_logprobs_equal_the_trainers_on_multimodal_rows(vlm, prompts):
    ids, vis = prompts
    eng = TransformersEngine(vlm)
    batch = eng.generate(ids, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, eos_id=2), n=3, vision=vis)
    assert batch["pixel_values"].shape[:2] == (12, 40) and batch["image_grid_thw"].shape == (12, 2, 3)
    assert torch.equal(batch["image_grid_thw"][6:9], torch.zeros(3, 2, 3, dtype=torch.long))  # the text prompt
    use, plain, shared = _gaps(vlm, batch)
    print(f"\nfp32 gap rollout vs trainer: plain {plain:.2e}, shared-prefix {shared:.2e}")
    assert use and plain < 1e-5 and shared < 1e-5
    # the vision special tokens are read, never sampled (their logit is suppressed at the head, both sides)
    assert not bool(torch.isin(batch["tokens"][batch["action_mask"]], torch.tensor([IMG, VS, VE, VID])).any())
    # M-RoPE positions matter: the same rows with 1-D positions give other log-probs (a path that dropped them
    # would be caught above)
    with torch.no_grad():
        t = batch["tokens"]
        from hyperrl.multimodal import model_inputs

        flat = vlm(input_ids=t[:, :-1], attention_mask=batch["attention_mask"][:, :-1].long(),
                   position_ids=(batch["attention_mask"][:, :-1].long().cumsum(-1) - 1).clamp_min(0),
                   **model_inputs(batch)).logits.float().log_softmax(-1)
    lp_flat = flat.gather(-1, t[:, 1:, None])[..., 0]
    act = batch["action_mask"][:, 1:]
    assert float((lp_flat - batch["rollout_logprobs"][:, 1:])[act].abs().max()) > 1e-3


def test_keyed_requests_carry_images_and_match_the_trainer(vlm, prompts):
    ids, vis = prompts
    eng = TransformersEngine(vlm)
    reqs = [Request(100 + i, tuple(ids[i // 3]), i // 3, vision=vis[i // 3]) for i in range(12)]
    batch = eng.generate_requests(reqs, SamplingParams(max_new_tokens=5, temperature=1.0, seed=7, eos_id=2))
    _, plain, shared = _gaps(vlm, batch)
    assert plain < 1e-5 and shared < 1e-5
    # a row's images are its prompt's: the packed grids say which
    for i in range(12):
        g = vis[i // 3][1] if vis[i // 3] is not None else torch.zeros(0, 3, dtype=torch.long)
        assert torch.equal(batch["image_grid_thw"][i][:len(g)], g)


def test_same_placeholders_other_images_are_other_prompts(vlm):
    """Two boards of the same size take the same placeholder tokens: the shared-prefix forward must not merge
    them (each row keeps its own image's log-probs)."""
    from transformers import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 4)
    vis = []
    for seed in (1, 2):
        o = proc(images=[_image(56, 56, seed)], return_tensors="pt")
        vis.append((o["pixel_values"], o["image_grid_thw"]))
    ids = expand_placeholders([1, VS, IMG, VE, 5, 7], IMG, vis[0][1])
    batch = TransformersEngine(vlm).generate([ids, ids], SamplingParams(max_new_tokens=4, seed=1, eos_id=2), n=4,
                                             vision=vis)
    _, inverse, first = prefix_groups(batch)
    assert len(first) == 2 and len(set(inverse[:4].tolist())) == 1 and len(set(inverse[4:].tolist())) == 1
    assert inverse[0] != inverse[4]
    _, plain, shared = _gaps(vlm, batch)
    assert plain < 1e-5 and shared < 1e-5


def test_images_for_a_text_model_are_refused_naming_it(prompts):
    ids, vis = prompts
    eng = TransformersEngine(tiny_qwen3(V))
    with pytest.raises(ValueError, match="text-only model"):
        eng.generate(ids, SamplingParams(max_new_tokens=2, seed=0, eos_id=2), vision=vis)


def test_placeholders_must_number_the_images():
    with pytest.raises(VisionError, match="2 image placeholders .* for 1 images"):
        expand_placeholders([1, IMG, 5, IMG], IMG, torch.tensor([[1, 4, 4]]))
    assert expand_placeholders([1, IMG, 5], IMG, torch.tensor([[1, 4, 6]])) == [1] + [IMG] * 6 + [5]


def test_an_aborted_row_resumes_with_its_prompts_images(vlm, prompts):
    import threading

    from hyperrl.rollout.requests import resume_requests

    ids, vis = prompts
    eng = TransformersEngine(vlm)
    reqs = [Request(200 + i, tuple(ids[i]), i, vision=vis[i]) for i in range(4)]
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5, eos_id=2)
    stop = threading.Event()
    stop.set()  # aborted before the first decode step: every row comes back unfinished
    resumed = resume_requests(eng.generate_requests(reqs, sp, abort=stop))
    assert [r.uid for r in resumed] == [200, 201, 202, 203]
    for r, v in zip(resumed, vis):
        if v is None:
            assert r.vision is None
        else:
            assert torch.equal(r.vision[0], v[0]) and torch.equal(r.vision[1], v[1])
    _, plain, shared = _gaps(vlm, eng.generate_requests(resumed, sp))
    assert plain < 1e-5 and shared < 1e-5
