from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hyperrl.data import CursorState, DataError, PromptDataset, PromptLoader, render_chat

DATA = Path(__file__).parent  # the fixtures live beside these tests


def test_shipped_gsm8k_parquet_answers_from_reward_model():
    ds = PromptDataset.from_parquet(DATA / "gsm8k_tiny.parquet")
    assert len(ds) == 4 and ds.skipped == 0
    assert ds[2].answer == "1,000" and ds[0].prompt[0]["role"] == "user"
    assert ds[0].source.endswith("gsm8k_tiny.parquet:0")
    assert render_chat(ds[0].prompt).startswith("user: Tom has 3 apples")


def _write(tmp_path, name, columns):
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def test_answer_fallbacks_and_custom_columns(tmp_path):
    p = _write(tmp_path, "a.parquet", {"question": ["q1", "q2", "q3"],
                                       "extra_info": [{"solution": "s1"}, None, None],
                                       "answer": [None, "a2", None]})
    with pytest.raises(DataError, match=r"a.parquet: column 'prompt' missing .*set data.prompt_key"):
        PromptDataset.from_parquet(p)
    with pytest.raises(DataError, match=r"a.parquet:2: no answer"):
        PromptDataset.from_parquet(p, prompt_key="question")
    ds = PromptDataset.from_parquet(p, prompt_key="question", bad_rows="skip")
    assert [s.answer for s in ds.samples] == ["s1", "a2"] and ds.skipped == 1
    q = _write(tmp_path, "b.parquet", {"prompt": ["x"], "extra_info": ["42"]})
    assert PromptDataset.from_parquet(q)[0].answer == "42"


@pytest.mark.parametrize("prompt, words", [("   ", "empty prompt"), ([], "non-empty list"),
                                           ([{"role": "user"}], "non-empty list")])
def test_bad_prompt_rows_named(tmp_path, prompt, words):
    if isinstance(prompt, str):
        cols = {"prompt": ["ok", prompt], "answer": ["1", "2"]}
    else:
        cols = {"prompt": [[{"role": "user", "content": "ok"}], prompt], "answer": ["1", "2"]}
    p = _write(tmp_path, "bad.parquet", cols)
    with pytest.raises(DataError, match=rf"bad.parquet:1: column 'prompt'.*{words}"):
        PromptDataset.from_parquet(p)
    ds = PromptDataset.from_parquet(p, bad_rows="skip")
    assert len(ds) == 1 and ds.skipped == 1


def test_wrong_type_and_missing_file(tmp_path):
    p = _write(tmp_path, "t.parquet", {"prompt": [3], "answer": ["1"]})
    with pytest.raises(DataError, match=r"t.parquet:0: column 'prompt' has type int"):
        PromptDataset.from_parquet(p)
    with pytest.raises(DataError, match="no such file"):
        PromptDataset.from_parquet(tmp_path / "nope.parquet")


def test_loader_deterministic_resumable_and_counts():
    ds = PromptDataset.from_parquet(DATA / "gsm8k_tiny.parquet")
    a = PromptLoader(ds, 3, seed=7)
    seq = [s.source for _ in range(5) for s in a.next_batch()]  # crosses epochs
    assert a.state.samples == 15 and a.state.epoch == 3 and a.state.index == 3
    # each epoch is a permutation of the dataset
    assert sorted(seq[:4]) == sorted(s.source for s in ds.samples)
    b = PromptLoader(ds, 3, seed=7)
    b.next_batch()
    b.next_batch()
    resumed = PromptLoader(ds, 3, seed=7, state=b.state)
    rest = [s.source for _ in range(3) for s in resumed.next_batch()]
    assert rest == seq[6:]
    resumed.add_tokens(120)
    assert resumed.state.tokens == 120 and isinstance(resumed.state, CursorState)
    # an explicit size per call reads the same stream (the loader's batch size is not changed)
    c = PromptLoader(ds, 3, seed=7)
    assert [s.source for s in c.next_batch(5) + c.next_batch(10)] == seq and c.batch_size == 3
    with pytest.raises(ValueError, match="k=0"):
        c.next_batch(0)
    with pytest.raises(DataError, match="empty"):
        PromptLoader(PromptDataset([]), 2)


@pytest.mark.parametrize("name, content, words", [
    ("t.parquet", b"this is not parquet at all" * 10, r"t.parquet: not a readable parquet file"),
    ("t.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", r"t.jsonl: not UTF-8 text \(byte 0\) — is it a jsonl file\?"),
    ("t.jsonl", b'{"prompt": "a"}\n[1, 2]\n', r"t.jsonl:2: a JSON object per line, got list"),
    ("t.json", b'[{"prompt": "a"}, 3]', r"t.json: item 1 is a int, expected a JSON object"),
    ("t.jsonl", b"[" * 100_000 + b"\n", r"t.jsonl:1: not JSON"),
])
def test_a_data_file_that_is_not_what_its_name_says_is_one_line(tmp_path, name, content, words):
    """RL prompts and preference pairs read files alike: a file that is not parquet / JSONL / JSON is a DataError
    naming the file (and line), never a traceback from pyarrow or json."""
    from hyperrl.data.preference import PairDataset
    from hyperrl.tokenizer import char_tokenizer

    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=words):
        PromptDataset.from_files(tmp_path / name)
    with pytest.raises(DataError, match=words):
        PairDataset.from_files([tmp_path / name], char_tokenizer())
    (tmp_path / "dir.parquet").mkdir()
    with pytest.raises(DataError, match=r"dir.parquet: not a file"):
        PromptDataset.from_files(tmp_path / "dir.parquet")
