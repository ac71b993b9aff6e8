"""Multimodal prompts as users have them (issue 32, item 3): real parquet files in verl's format (``<image>``
placeholders, ``images`` as ``{bytes, path}``) and TRL's (conversational parts, one ``image`` column), PNG images
made here with Pillow, decoded once at load; a missing file, undecodable bytes and a placeholder count that does
not match the images are errors naming the file, row and column."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from hyperrl.data.images import count_placeholders, vision_samples
from hyperrl.data.parquet import DataError


def _png(w: int, h: int, colour: tuple) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_rows_decode_their_images_in_placeholder_order(tmp_path):
    Image.new("RGB", (7, 5), (0, 0, 255)).save(tmp_path / "blue.png")
    rows = [{"prompt": [{"role": "user", "content": "<image><image>Which is larger?"}],
             "images": [{"bytes": _png(4, 3, (255, 0, 0)), "path": None}, {"bytes": None, "path": "blue.png"}],
             "reward_model": {"ground_truth": "1", "style": "rule"}, "data_source": "geo3k"}]
    got = vision_samples(_write(tmp_path / "train.parquet", rows))
    assert len(got) == 1 and got[0].answer == "1" and got[0].source.endswith("train.parquet:0")
    first, second = got[0].images
    assert first.size == (4, 3) and first.getpixel((0, 0)) == (255, 0, 0)  # bytes, then the relative path
    assert second.size == (7, 5) and second.getpixel((0, 0)) == (0, 0, 255) and second.mode == "RGB"


def test_trl_conversational_parts_and_one_image_column(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count them."}]}],
             "image": {"bytes": _png(2, 2, (0, 255, 0)), "path": None}, "answer": "3"}]
    got = vision_samples(_write(tmp_path / "trl.parquet", rows))
    assert got[0].answer == "3" and len(got[0].images) == 1 and got[0].images[0].getpixel((1, 1)) == (0, 255, 0)


def test_placeholders_are_counted_in_strings_and_parts():
    assert count_placeholders("<image> and <image>") == 2
    parts = [{"type": "image"}, {"type": "text", "text": "<image>"}]
    assert count_placeholders([{"role": "system", "content": "no images"}, {"role": "user", "content": parts}]) == 2


@pytest.mark.parametrize("images, msg", [
    ([{"bytes": None, "path": "nowhere.png"}],
     r"train.parquet:0: column 'images'\[0\]: no such image file .*nowhere.png"),
    ([{"bytes": b"not an image", "path": None}], r"train.parquet:0: column 'images'\[0\]: not a readable image"),
    ([], r"train.parquet:0: column 'prompt' has 1 image placeholder\(s\) but the row has 0 image\(s\)"),
])
def test_bad_images_are_named_with_file_row_and_column(tmp_path, images, msg):
    rows = [{"prompt": "<image> what is it?", "images": images or None, "answer": "x"}]
    with pytest.raises(DataError, match=msg):
        vision_samples(_write(tmp_path / "train.parquet", rows))
