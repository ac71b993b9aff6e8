"""Delta against full publication (issue 33, item 1) on a bf16 engine fed by fp32 master weights at RL learning
rates: a Qwen3-0.6B-shaped model (hidden 1024, 16 heads × 128, MLP 3072, vocab 151,936; ``--layers`` of its 28,
default 4 — the embedding and head are most of the bytes either way) trained with AdamW on a causal-LM loss over
random token batches; after every step the policy is published to two transformers engines (bf16), one by delta
(:mod:`hyperrl.rollout.delta`) and one in full, each timed end to end (gather, cast, encode / stage, verify,
commit). Prints, per learning rate, the fraction of bf16 elements that changed, the bytes and the times, checks
that both engines hold bit-identical weights, and appends the table to benchmarks/RESULTS.md.

    python benchmarks/delta.py --lrs 1e-6 3e-6 1e-5 --steps 5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402


def run(lr: float, steps: int, layers: int, seed: int = 0) -> list[list]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hyperrl.rollout.engines import ENGINES, EngineContext
    from hyperrl.rollout.publisher import Publisher
    from hyperrl.tokenizer import char_tokenizer

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    policy = Qwen3ForCausalLM(cfg)  # fp32 master weights
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    tok = char_tokenizer()
    engines = [ENGINES.build("transformers")(EngineContext(policy, torch.device("cpu"), torch.bfloat16, seed,
                                                           tempfile.mkdtemp(), tok)) for _ in range(2)]
    pubs = [Publisher.for_engine(policy, e) for e in engines]
    pubs[0].publish(policy, 1, delta=True)  # the first: full (no base)
    pubs[1].publish(policy, 1)
    rows = []
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=g)
        loss = policy(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        pubs[0].publish(policy, step + 1, delta=True)
        t_delta = time.perf_counter() - t0
        t0 = time.perf_counter()
        pubs[1].publish(policy, step + 1)
        t_full = time.perf_counter() - t0
        last = pubs[0].last
        rows.append([f"{lr:g}", step, last["delta_frac"], last["publish_bytes"] / 2**20,
                     last["publish_full_bytes"] / 2**20, last["publish_full_bytes"] / last["publish_bytes"],
                     t_delta, t_full, t_full / t_delta])
    a, b = (e.model.state_dict() for e in engines)
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a), "delta ≠ full publication"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    rows = [r for lr in args.lrs for r in run(lr, args.steps, args.layers)]
    out = table(["lr", "step", "delta_frac", "delta MiB", "full MiB", "bytes full/delta", "delta s", "full s",
                 "time full/delta"], rows)
    print(out)
    if not args.no_record:
        append_results("delta", f"Qwen3-0.6B-shaped ({args.layers} layers), fp32 AdamW master → bf16 transformers "
                       "engine, one process; both engines bit-identical after every run.\n\n" + out)


if __name__ == "__main__":
    main()
