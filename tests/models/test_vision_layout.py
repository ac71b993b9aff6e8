"""The per-row vision layout against a real model (issue 32): a tiny random Qwen2.5-VL (vision tower included)
fed a right-padded batch of rows with 1, 0 and 2 images of different sizes — its inputs from
``model_inputs(pack_vision(…))`` — gives every row the logits that row gets alone, at every real position."""

import numpy as np
import torch
from PIL import Image

from hyperrl.models import tiny_qwen2_5_vl
from hyperrl.multimodal import model_inputs, pack_vision
from hyperrl.trajectory import check_vision

V, IMG, VS, VE, VID = 64, 60, 61, 62, 63


def _image(h: int, w: int, seed: int):
    g = np.random.default_rng(seed)
    return Image.fromarray((g.random((h, w, 3)) * 255).astype("uint8"))


def test_a_padded_multimodal_batch_gives_each_row_its_own_logits():
    from transformers import Qwen2VLImageProcessorPil

    model = tiny_qwen2_5_vl(V, image_token_id=IMG, vision_start_id=VS, vision_end_id=VE, video_token_id=VID)
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    specs = [[(60, 90)], [], [(56, 56), (90, 60)]]  # images per row, (height, width) before the processor's resize
    rows, ids = [], []
    for r, imgs in enumerate(specs):
        if imgs:
            o = proc(images=[_image(h, w, 10 * r + i) for i, (h, w) in enumerate(imgs)], return_tensors="pt")
            rows.append((o["pixel_values"], o["image_grid_thw"]))
            body = [t for g in o["image_grid_thw"] for t in [VS] + [IMG] * (int(g.prod()) // 4) + [VE]]
        else:
            rows.append((None, None))
            body = []
        ids.append([1, 5 + r] + body + [7, 8, 9 + r][: 3 - r % 2])
    T = max(len(x) for x in ids)
    tokens = torch.tensor([x + [0] * (T - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids])
    packed = pack_vision(rows)
    from tensordict import TensorDict

    batch = TensorDict({"tokens": tokens, "attention_mask": mask.bool(), **packed}, batch_size=[3])
    check_vision(batch, image_token_id=IMG)
    with torch.no_grad():
        together = model(input_ids=tokens, attention_mask=mask, **model_inputs(batch)).logits
        for r, x in enumerate(ids):
            one = batch[r:r + 1]
            alone = model(input_ids=torch.tensor([x]), **model_inputs(one)).logits[0]
            gap = float((together[r, :len(x)] - alone).abs().max())
            assert gap < 1e-5, (r, gap)
