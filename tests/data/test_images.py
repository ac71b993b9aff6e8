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


def test_a_large_image_is_downscaled_at_load_from_its_header_never_kept_whole(tmp_path):
    """A 3,000 × 2,000 PNG with max_pixels 112²: kept at ≤ 12,544 pixels, aspect kept (the processor would shrink
    it to that anyway); smaller images are untouched."""
    rows = [{"prompt": "<image><image>", "images": [{"bytes": _png(3000, 2000, (9, 9, 9)), "path": None},
                                                     {"bytes": _png(40, 30, (1, 2, 3)), "path": None}], "answer": "x"}]
    big, small = vision_samples(_write(tmp_path / "t.parquet", rows), max_pixels=112 * 112)[0].images
    assert big.width * big.height <= 112 * 112 and abs(big.width / big.height - 1.5) < 0.05
    assert big.getpixel((0, 0)) == (9, 9, 9) and small.size == (40, 30)


def test_a_decompression_bomb_is_a_data_error_naming_the_row(tmp_path, monkeypatch):
    """Past Pillow's MAX_IMAGE_PIXELS (lowered here to keep the test small): refused at its header, named."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    rows = [{"prompt": "<image>", "images": [{"bytes": _png(200, 100, (0, 0, 0)), "path": None}], "answer": "x"}]
    with pytest.raises(DataError, match=r"t.parquet:0: column 'images'\[0\]: refused as a decompression bomb"):
        vision_samples(_write(tmp_path / "t.parquet", rows))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_image_paths_stay_inside_the_data_files_directory(tmp_path, how):
    """``../``, an absolute path and a symlink leading out are refused — the same message whether or not the
    outside file exists (nothing is revealed); ``image_root`` lets one other directory in."""
    data, outside = tmp_path / "data", tmp_path / "secret"
    data.mkdir()
    outside.mkdir()
    Image.new("RGB", (3, 3)).save(outside / "x.png")
    if how == "symlink":
        (data / "link.png").symlink_to(outside / "x.png")
    path = {"dotdot": "../secret/{}.png", "absolute": str(outside) + "/{}.png", "symlink": "link.png"}[how]
    messages = []
    for name in ("x", "missing"):
        if how == "symlink" and name == "missing":
            (data / "link.png").unlink()
            (data / "link.png").symlink_to(outside / "missing.png")
        rows = [{"prompt": "<image>", "images": [{"bytes": None, "path": path.format(name)}], "answer": "a"}]
        with pytest.raises(DataError, match=r"leads outside the data file's directory") as e:
            vision_samples(_write(data / "t.parquet", rows))
        messages.append(str(e.value).replace("missing", "x"))
    assert messages[0] == messages[1]  # exists or not: the same words
    if how != "symlink":
        rows = [{"prompt": "<image>", "images": [{"bytes": None, "path": path.format("x")}], "answer": "a"}]
        assert vision_samples(_write(data / "t.parquet", rows), image_root=outside)[0].images[0].size == (3, 3)


@pytest.mark.parametrize("content, words", [(b"\x00\x01garbage" * 100, "not a readable parquet file"),
                                            (b"PAR1" + b"\x00" * 64 + b"PAR1", "not a readable parquet file")])
def test_a_data_file_that_is_not_parquet_is_one_line(tmp_path, content, words):
    (tmp_path / "t.parquet").write_bytes(content)
    with pytest.raises(DataError, match=words):
        vision_samples(tmp_path / "t.parquet")
