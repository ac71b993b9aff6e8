"""Multimodal data files through the loop (issue 32, item 3): ``data.train_files`` in verl's format (``<image>`` in a
chat prompt, an ``images`` column of ``{bytes}``) and in TRL's (``{"type": "image"}`` parts, one ``image`` column)
train a vision-language policy — the same board and question encode to the same tokens and pixels from either
format, the images go through the model's own processor, and the trainer's log-probs of the multimodal rows equal
the rollout's (the bit-exact gate). Images given to a text model are refused before anything is trained, naming
the row and the column."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.data import DataError
from hyperrl.data.tasks import VisionFileTask
from hyperrl.data.visual import draw_board


def _png(board: str) -> bytes:
    buf = io.BytesIO()
    draw_board(tuple(board), 2, 14).save(buf, format="PNG")
    return buf.getvalue()


BOARDS = ["rgby", "gbyr", "yyrb", "bgrr"]


def _files(tmp_path):
    verl = [{"prompt": [{"role": "user", "content": f"<image>c{i % 4}?"}], "images": [{"bytes": _png(b), "path": None}],
             "reward_model": {"ground_truth": b[i % 4], "style": "rule"}, "data_source": "boards"}
            for i, b in enumerate(BOARDS)]
    trl = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"c{i % 4}?"}]}],
            "image": {"bytes": _png(b), "path": None}, "answer": b[i % 4]} for i, b in enumerate(BOARDS)]
    paths = []
    for name, rows in (("verl.parquet", verl), ("trl.parquet", trl)):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
        paths.append(str(tmp_path / name))
    return paths


def _config(tmp_path, files, **model):
    cfg = {"model": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, **model},
           "data": {"train_files": files, "val_files": files[:1], "apply_chat_template": "never",
                    "rewards": ["exact_answer"]},
           "rollout": {"prompts_per_step": 4, "n": 4, "max_new_tokens": 2},
           "algo": {"recipe": "grpo", "gate_threshold": 1e-4},
           "run": {"steps": 2, "eval_every": 0, "eval_prompts": 4, "threads": 1, "out_dir": str(tmp_path / "run")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path, [])


def test_verl_and_trl_image_files_train_a_vision_language_policy(tmp_path):
    verl, trl = _files(tmp_path)
    tr = build_trainer(_config(tmp_path, [verl, trl], vision={"rope_theta": 10}))
    task = tr.task
    assert isinstance(task, VisionFileTask) and len(task.dataset) == 8
    rows = sorted(task.dataset.samples, key=lambda s: s.source)
    t, v = rows[:4], rows[4:]  # trl.parquet:0..3, verl.parquet:0..3: the same boards and questions
    for a, b in zip(t, v):
        assert task.encode(a) == task.encode(b)  # either format → the same tokens
        (pa_, ga), (pb, gb) = task.vision(a), task.vision(b)
        assert torch.equal(pa_, pb) and torch.equal(ga, gb)
    ids, (pixels, grid) = task.encode(v[0]), task.vision(v[0])
    want = task.image_processor(images=[draw_board(tuple(BOARDS[0]), 2, 14)], return_tensors="pt")
    assert torch.equal(pixels, want["pixel_values"]) and torch.equal(grid, want["image_grid_thw"])
    # one placeholder per 2 × 2 merged patches of the image's grid, between the vision start and end tokens
    assert ids.count(task.image_token_id) == int(grid.prod()) // 4
    assert task.reward(BOARDS[0][0], v[0]) == 1.0 and v[0].extra["data_source"] == "boards"
    steps = [tr.step() for _ in range(2)]
    assert max(m["mismatch_max_abs"] for m in steps) < 1e-4  # the trainer's view of the rows is the rollout's
    assert tr.evaluate()["eval_reward_exact_answer_mean"] >= 0.0


def test_images_for_a_text_model_are_refused_naming_row_and_column(tmp_path):
    verl, _ = _files(tmp_path)
    with pytest.raises(DataError, match=r"verl.parquet:0: column 'images' holds images but the model is text-only"):
        build_trainer(_config(tmp_path, [verl]))


def test_prompt_bounds_count_each_image_expanded(tmp_path):
    """``max_prompt_length`` and ``longest_prompt`` (the context check) count a prompt as the engine sees it: a
    56 × 56 board is 4 × 4 patches = 4 placeholders after the 2 × 2 merge, not the one the prompt writes."""
    from transformers import Qwen2VLImageProcessorPil

    from hyperrl.multimodal import VISION_SPECIAL_TOKENS
    from hyperrl.tokenizer import char_tokenizer

    buf = io.BytesIO()
    draw_board(tuple("rgby"), 2, 28).save(buf, format="PNG")
    rows = [{"prompt": "<image>c1?", "images": [{"bytes": buf.getvalue(), "path": None}], "answer": "g"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "big.parquet")
    tok = char_tokenizer(specials=VISION_SPECIAL_TOKENS)
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, temporal_patch_size=2,
                                    merge_size=2)
    files = [str(tmp_path / "big.parquet")]
    task = VisionFileTask(tok, proc, files)
    ids = task.encode(task.dataset.samples[0])
    assert ids.count(task.image_token_id) == 4 and task.longest_prompt == len(ids) == 10  # <bos> + 3 + 3 + 3 chars
    assert len(VisionFileTask(tok, proc, files, max_prompt_length=10).dataset) == 1
    with pytest.raises(DataError, match=r"big.parquet:0: prompt of 10 tokens > data.max_prompt_length=9"):
        VisionFileTask(tok, proc, files, max_prompt_length=9)
    with pytest.raises(DataError, match="dataset is empty"):  # filtered out: the one row is over the bound
        VisionFileTask(tok, proc, files, max_prompt_length=9, overlong_prompts="filter")
    with pytest.raises(ValueError, match="truncate with images"):
        VisionFileTask(tok, proc, files, max_prompt_length=9, overlong_prompts="truncate")
