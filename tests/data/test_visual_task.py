"""The visual task (issue 32, item 4): boards drawn in code, the question's answer read off the image, held-out
boards never trained on, prompts whose placeholders match the image the processor makes of the board."""

import numpy as np
import pytest
import torch

from hyperrl.config import ConfigError, load_config
from hyperrl.data.tasks import TASKS, make_task
from hyperrl.data.visual import PALETTE, draw_board
from hyperrl.multimodal import VISION_SPECIAL_TOKENS
from hyperrl.tokenizer import char_tokenizer


@pytest.fixture(scope="module")
def task():
    from transformers import Qwen2VLImageProcessorPil

    tok = char_tokenizer(specials=VISION_SPECIAL_TOKENS)
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2,
                                    merge_size=2)
    spec = load_config(overrides=["model.vision={}", "task.name=shapes", "task.questions=[colour, count]"]).task
    return make_task(spec, tok, seed=0, image_processor=proc)


def test_answers_are_read_off_the_drawn_board(task):
    for s in task.sample(64, step=3):
        board = s.extra["board"]
        px = np.asarray(draw_board(tuple(board), task.grid, task.cell))
        q = s.prompt.split(">")[-1]
        if q.startswith("c"):  # the cell's centre pixel is the answer's colour
            i = int(q[1:-1])
            r, k = divmod(i, task.grid)
            c = task.cell
            assert tuple(px[r * c + c // 2, k * c + c // 2]) == PALETTE[s.answer]
        else:
            assert s.answer == str(board.count(q[1]))


def test_prompts_take_the_images_placeholders_and_held_out_boards_are_never_trained_on(task):
    tok = task.tokenizer
    img = tok.convert_tokens_to_ids("<|image_pad|>")
    s = task.sample(1, step=0)[0]
    pv, grid = task.vision(s)
    ids = task.encode(s)
    assert grid.tolist() == [[1, 4, 4]] and pv.shape == (16, 3 * 2 * 14 * 14)  # 56 × 56 pixels: 4 × 4 patches
    assert ids.count(img) == 4  # 16 patches merged 2 × 2
    assert task.vision(s)[0] is pv  # processed once, cached
    train = {x.extra["board"] for step in range(200) for x in task.sample(32, step)}
    held = {x.extra["board"] for x in task.held_out(256)}
    assert held and not train & held
    assert len(held) == round(0.2 * 4 ** 4)


def test_a_visual_task_without_a_vision_language_model_is_refused_at_load():
    with pytest.raises(ConfigError, match="task.name=shapes: a visual task needs a vision-language policy"):
        load_config(overrides=["task.name=shapes"])
    with pytest.raises(ValueError, match="task.colours='rq'"):
        TASKS.build("shapes", colours="rq")(char_tokenizer(specials=VISION_SPECIAL_TOKENS), 0, object())


@pytest.mark.parametrize("override,named", [("optim.pack_tokens=256", "optim.pack_tokens"),
                                            ("run.cp=2", "run.cp"),
                                            ("algo.advantage={name: gae}", "a critic")])
def test_what_does_not_carry_images_yet_is_refused_at_load(override, named):
    with pytest.raises(ConfigError, match=f"vision-language policy .*{named}"):
        load_config(overrides=["model.vision={}", "task.name=shapes", override])


def test_the_image_is_the_boards_cells(task):
    img = np.asarray(draw_board(("r", "g", "b", "y"), 2, 28))
    assert img.shape == (56, 56, 3)
    assert tuple(img[10, 40]) == PALETTE["g"] and tuple(img[40, 10]) == PALETTE["b"]
    assert torch.is_tensor(task.vision(task.held_out(1)[0])[0])
