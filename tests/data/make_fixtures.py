"""Regenerate the tiny fixtures shipped with the tests (no downloads):
gsm8k_tiny.parquet (verl's column layout), code_tiny.parquet (code-RL rows in verl's layout: the unit tests as
the ground truth — asserts, or stdin/stdout pairs as a JSON string), pairs_tiny.parquet (preference pairs:
prompt / chosen / rejected, TRL's and verl's explicit plain format, arithmetic the character tokenizer encodes)
and corpus.jsonl (for BM25 search)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent

ROWS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("A box holds 12 pens. How many pens are in 5 boxes?", "12 * 5 = 60\n#### 60"),
    ("Sara had $1,250 and spent $250. How much is left?", "1250 - 250 = 1000\n#### 1,000"),
    ("There are 9 birds; 4 fly away. How many remain?", "9 - 4 = 5\n#### 5"),
]


def main():
    table = pa.table({
        "data_source": ["gsm8k"] * len(ROWS),
        "prompt": [[{"role": "user", "content": q}] for q, _ in ROWS],
        "reward_model": [{"style": "rule", "ground_truth": a.split("####")[1].strip()} for _, a in ROWS],
        "extra_info": [{"index": i, "answer": a} for i, (_, a) in enumerate(ROWS)],
    })
    pq.write_table(table, HERE / "gsm8k_tiny.parquet")
    pairs = [(12, 30, 17), (7, 25, 23), (40, 9, 94), (3, 3, 9), (21, 21, 24), (5, 38, 34), (16, 27, 34), (8, 0, 80)]
    pq.write_table(pa.table({"prompt": [f"{a:02d}+{b:02d}=" for a, b, _ in pairs],
                             "chosen": [f"{a + b:02d}" for a, b, _ in pairs],
                             "rejected": [f"{w:02d}" for _, _, w in pairs]}), HERE / "pairs_tiny.parquet")
    docs = [
        {"id": 0, "text": "Paris is the capital and largest city of France."},
        {"id": 1, "text": "Berlin is the capital of Germany."},
        {"id": 2, "text": "The Nile is a major north-flowing river in Africa."},
        {"id": 3, "text": "Mount Everest is Earth's highest mountain above sea level."},
    ]
    (HERE / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    code = [("f(1)=4, f(2)=7, f(3)=10. def f(x): return ",
             ["assert f(1) == 4", "assert f(2) == 7", "assert f(3) == 10"]),
            ("f(1)=2, f(2)=4. def f(x): return ", ["assert f(1) == 2", "assert f(2) == 4"]),
            ("print a+b for the two numbers on stdin: ", {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})]
    pq.write_table(pa.table({
        "data_source": ["code"] * len(code),
        "prompt": [[{"role": "user", "content": q}] for q, _ in code],
        "reward_model": [{"style": "rule", "ground_truth": json.dumps(t)} for _, t in code],
        "extra_info": [{"index": i} for i in range(len(code))],
    }), HERE / "code_tiny.parquet")


if __name__ == "__main__":
    main()
