"""Context parallelism (``run.cp``): the update's peak memory per rank and its time at a long response.

One update step of the trainer (``prepare`` + ``update``: forward, backward, optimizer) on a synthetic rollout
batch — ``--rows`` rows of an 8-token prompt and a ``--response``-token response (4,096 by default) — with a
random-initialised tiny Qwen3 sized by ``--hidden`` / ``--layers`` / ``--heads``, for each ``cp`` of
``--cp``: ``cp = 1`` is one process; ``cp > 1`` is ``torchrun --nproc-per-node cp`` with ``run.cp = cp`` (one
context-parallel group training the same rows, each rank a ``1/cp`` slice of every sequence). Each rank
reports its process's peak RSS before and after the step (``ru_maxrss``); the table gives the step's own
memory (the increase) on the largest rank, its ratio to ``cp = 1``, and the update's wall time (on this
machine's 2 cores ``cp`` processes share them: the time ratio is an upper bound). ``--vocab`` replaces the
task's tokenizer-sized vocabulary by a real one (a checkpoint is written), where the ``[B, T, V]`` logits
dominate. ``--fused off on``: the LM head unfused and fused with the log-prob (``optim.fused_head``), side by side;
``--response``, ``--checkpointing`` and ``--attention`` (``run.cp_attention``: ulysses / ring, at ``cp > 1``) take
several values too (every combination runs). Appends to RESULTS.md.

    python benchmarks/cp.py --cp 1 2 4 --response 4096
    python benchmarks/cp.py --cp 1 --response 8192 --vocab 151936 --fused off on
    python benchmarks/cp.py --cp 1 4 --response 8192 --attention ulysses ring
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402

_CHILD = r"""
import json, resource, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from benchmarks._common import synthetic_update_batch
from hyperrl.compose import build_trainer
from hyperrl.config import load_config
out, cp, rows, R = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
extra = json.loads(sys.argv[6])
from hyperrl.distributed import init_distributed
init_distributed()
cfg = load_config(None, [f"--run.out_dir={out}", f"--run.cp={cp}", f"--rollout.n={rows}",
                         "--rollout.prompts_per_step=1", "--run.eval_every=0", "--optim.micro_batch_tokens=0", *extra])
tr = build_trainer(cfg)
batch = synthetic_update_batch(rows, R)
built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
batch, _ = tr.prepare(batch)
m = tr.update(batch)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"built_mib": built / 1024, "peak_mib": peak / 1024, "update_s": dt, "loss": m["loss_policy"]}))
"""


def _run(cp: int, out: str, rows: int, response: int, extra: list[str]) -> list[dict]:
    head = [sys.executable] if cp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             f"--nproc-per-node={cp}"]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // cp))}
    r = subprocess.run([*head, f.name, str(ROOT), out, str(cp), str(rows), str(response), json.dumps(extra)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    os.unlink(f.name)
    if r.returncode:
        raise RuntimeError(r.stderr[:3000] + "\n…\n" + r.stderr[-3000:])
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--response", type=int, nargs="+", default=[4096])
    ap.add_argument("--fused", nargs="+", default=["off"], choices=["off", "on"], help="optim.fused_head")
    ap.add_argument("--checkpointing", nargs="+", default=["off"], choices=["off", "on"],
                    help="model.gradient_checkpointing")
    ap.add_argument("--attention", nargs="+", default=["ulysses"], choices=["ulysses", "ring"],
                    help="run.cp_attention (cp > 1)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=0, help="a real vocabulary size (0 = the task tokenizer's)")
    ap.add_argument("--extra", nargs="*", default=[], help="more config overrides, e.g. --algo.advantage.singleton=raw "
                    "for --rows 1")
    args = ap.parse_args()
    model = [f"--model.hidden={args.hidden}", f"--model.layers={args.layers}", f"--model.heads={args.heads}",
             f"--model.kv_heads={args.heads // 2}", f"--model.head_dim={args.hidden // args.heads}",
             f"--model.intermediate={3 * args.hidden}"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.vocab:
            from hyperrl.models.tiny import tiny_qwen3

            ckpt = Path(tmp) / "ckpt"
            tiny_qwen3(args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.heads // 2,
                       head_dim=args.hidden // args.heads, intermediate=3 * args.hidden).save_pretrained(ckpt)
            from hyperrl.tokenizer import char_tokenizer

            char_tokenizer().save_pretrained(ckpt)  # the task's tokenizer beside the wider embedding
            model = [f"--model.checkpoint={ckpt}"]
        combos = [(R, f, g, cp, a if cp > 1 else "-") for R in args.response for f in args.fused
                  for g in args.checkpointing for cp in args.cp for a in (args.attention if cp > 1 else ["-"])]
        res = {}
        for R, f, g, cp, a in combos:
            extra = [*model, f"--optim.fused_head={f}", f"--model.gradient_checkpointing={g == 'on'}",
                     *([f"--run.cp_attention={a}"] if cp > 1 else []), *args.extra]
            res[R, f, g, cp, a] = _run(cp, f"{tmp}/{R}-{f}-{g}-cp{cp}-{a}", args.rows, R, extra)
    own = {k: max(r["peak_mib"] - r["built_mib"] for r in rs) for k, rs in res.items()}
    t = {k: max(r["update_s"] for r in rs) for k, rs in res.items()}
    rows = []
    for k in combos:
        R, f, g, cp, a = k
        base = next(c for c in combos if c[0] == R)  # the first combination at this length
        rows.append([R, f, g, cp, a, len(res[k]), round(max(r["built_mib"] for r in res[k])), round(own[k]),
                     f"{own[k] / own[base]:.2f}", f"{t[k]:.1f}", f"{t[k] / t[base]:.2f}", f"{res[k][0]['loss']:.6f}"])
    vocab = f"vocabulary {args.vocab:,}" if args.vocab else "the arith tokenizer's vocabulary"
    body = (f"One update (prepare + update: forward, backward, AdamW) of a random tiny Qwen3 (hidden {args.hidden}, "
            f"{args.layers} layers, {args.heads} heads, {vocab}) on {args.rows} rows of an 8-token prompt + "
            "response of each length; fused head: optim.fused_head; checkpointing: model.gradient_checkpointing; "
            "cp > 1: torchrun, one context-parallel group (attention: run.cp_attention), each rank a 1/cp slice of "
            "every sequence; the step's own memory = peak RSS − RSS after build, largest rank; ratios against the "
            "first row of the same length; time: the update's wall seconds (cp processes share 2 cores)\n\n"
            + table(["response", "fused head", "checkpointing", "cp", "attention", "ranks", "after build MiB",
                     "step's own MiB", "memory ratio", "update s", "time ratio", "loss"], rows))
    print(body)
    append_results("context parallelism: the update's memory per rank at a long response", body)


if __name__ == "__main__":
    main()
