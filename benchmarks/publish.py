"""Publication into an engine, side by side in one run:

* the transformers engine that keeps its own copy (publication copies every tensor) vs the one
  sharing the trainer's weights (``share_weights``: a checked version bump);
* vLLM's in-place update through a safetensors file per version (the old path) vs shared memory
  (``transport="shm"``: pieces copied into one /dev/shm segment, the worker clones them out).

Models: the tiny default and a Qwen3-0.6B-shaped random model (hidden 1024, 28 layers, 16/8
heads, head_dim 128, intermediate 3072, vocab 151,936; fp32). Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/publish.py [--sizes tiny,0.6b] [--repeat 3]

Appends the table (median seconds per publication, ratios) to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=None),
    "0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936),
}


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,0.6b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    import torch

    from benchmarks._common import append_results, table, timeit
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import TransformersEngine
    from hyperrl.rollout.publisher import Publisher
    from hyperrl.tokenizer import char_tokenizer

    torch.set_num_threads(2)
    tok = char_tokenizer()
    rows = []
    for size in args.sizes.split(","):
        cfg = dict(SIZES[size])
        vocab = cfg.pop("vocab") or tok.vocab_size
        model = tiny_qwen3(vocab, **cfg, max_positions=256)
        n = sum(p.numel() for p in model.parameters())
        version = [0]

        def publisher_for(engine):
            pub = Publisher.for_engine(model, engine)

            def publish():
                version[0] += 1
                pub.publish(model, version[0])

            return publish

        copying = TransformersEngine(copy.deepcopy(model))
        t_copy = timeit(publisher_for(copying), repeat=args.repeat)
        del copying
        version[0] = 0
        t_shared = timeit(publisher_for(TransformersEngine(model, shared=True)), repeat=args.repeat)
        rows.append([size, f"{n / 1e6:.1f}M", "transformers: own copy", t_copy, ""])
        rows.append([size, "", "transformers: shared weights", t_shared, f"{t_copy / t_shared:.1f}× faster"])
        if args.no_vllm:
            continue
        from hyperrl.rollout.vllm_engine import VLLMEngine

        d = tempfile.mkdtemp()
        model.save_pretrained(d)
        eng = VLLMEngine(d, dtype="float32", seed=0, max_model_len=256, kv_cache_gib=1)
        times, reload = {}, {}
        for transport in ("file", "shm"):
            eng.transport = transport
            publish, seen = publisher_for(eng), []

            def timed(publish=publish, seen=seen, eng=eng):
                publish()
                seen.append(eng.last_reload_s)

            times[transport] = timeit(timed, repeat=args.repeat)
            reload[transport] = statistics.median(seen)
        eng.close()
        hand = {k: times[k] - reload[k] for k in times}  # staging + checks + transport: what hyperrl owns
        rows.append([size, "", "vLLM: safetensors file", times["file"],
                     f"of which vLLM's reload {reload['file']:.3g} s; the rest {hand['file']:.3g} s"])
        rows.append([size, "", "vLLM: shared memory", times["shm"],
                     f"{times['file'] / times['shm']:.1f}× end to end; the rest {hand['shm']:.3g} s: "
                     f"{hand['file'] / hand['shm']:.1f}× faster"])
        del eng
    append_results("publish", "Median seconds per publication (`Publisher.publish`, one process, fp32). vLLM's "
                   "own reload (`reload_weights`: on CPU it re-packs every linear layer into oneDNN's format) is the "
                   "same for both transports and timed inside the worker; 'the rest' is staging, checks and "
                   "transport:\n\n" + table(["model", "params", "path", "s", "ratio / split"], rows))


if __name__ == "__main__":
    main()
