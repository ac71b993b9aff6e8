"""Token-balanced rows across data-parallel ranks (``optim.balance_rows``): how unevenly the ranks work on a step
whose responses range 64–4,096 tokens, balanced and not.

``torchrun --nproc-per-node --ranks`` runs one update of the trainer (a random tiny Qwen3, FSDP2 over the ranks):
``prepare``, then the timed ``update``, on a synthetic rollout batch per rank — ``--rows`` rows of an 8-token prompt
and a long-tailed response of ``64 · 2^(6 u³)`` tokens (u uniform; 64 … 4,096, most short), each rank drawing its
own. Each rank reports the tokens it trained and the CPU seconds its process spent in the update, the rows'
exchange included (``time.process_time``: computing, not waiting in a collective); the table gives the slowest
rank ÷ the mean of each, with ``optim.balance_rows`` off and on, side by side for each of ``--seeds``. Appends to
RESULTS.md.

    python benchmarks/balance.py --ranks 2 --rows 32 --group 4 --seeds 0 1 2 3
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
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
import hyperrl.transforms as T
from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.distributed import init_distributed
from hyperrl.trajectory import make_trajectory
out, rows, balance, seed, group = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
init_distributed()
rank = torch.distributed.get_rank()
tr = build_trainer(load_config(None, [f"--run.out_dir={out}", "--run.eval_every=0", "--run.threads=1",
                                      f"--rollout.prompts_per_step={torch.distributed.get_world_size()}",
                                      f"--rollout.n={rows}", f"--optim.balance_rows={balance}",
                                      "--optim.micro_batch_tokens=8192"]))
g = torch.Generator().manual_seed(seed * 100 + rank)
lens = (64 * 2 ** (6 * torch.rand(rows, generator=g) ** 3)).round().long()
Tn = 8 + int(lens.max())
pos = torch.arange(Tn)[None, :]
real = pos < 8 + lens[:, None]
act = real & (pos >= 8)
tokens = torch.where(real, torch.randint(3, 20, (rows, Tn), generator=g), 0)
batch = T.compute_advantages(make_trajectory(
    tokens=tokens, attention_mask=real, action_mask=act, rollout_logprobs=torch.where(act, -3.0, 0.0),
    group_id=torch.arange(rows) // group, policy_version=torch.zeros(rows, dtype=torch.long),
    reward=torch.rand(rows, generator=g)), "grpo")
torch.distributed.barrier()
trained = {}
update = tr.learner.update

def counted(b, *a, **k):
    trained["tokens"] = int(b["attention_mask"].sum())
    return update(b, *a, **k)

tr.learner.update = counted
batch, _ = tr.prepare(batch)  # old log-probs on the rows this rank generated
torch.distributed.barrier()
c0, t0 = time.process_time(), time.perf_counter()
m = tr.update(batch)  # the rows balanced first (optim.balance_rows), then forward, backward, AdamW
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
with open(f"{out}.rank{rank}.json", "w") as f:  # one file a rank: the ranks' stdout lines interleave
    json.dump({"rank": rank, "tokens": trained["tokens"], "cpu_s": cpu, "wall_s": wall}, f)
"""


def _run(ranks: int, rows: int, balance: bool, seed: int, group: int, out: str) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        f.name, str(ROOT), out, str(rows), str(balance).lower(), str(seed), str(group)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    os.unlink(f.name)
    if r.returncode:
        raise RuntimeError(r.stderr[-4000:])
    return [json.loads(Path(f"{out}.rank{k}.json").read_text()) for k in range(ranks)]


def _ratio(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32, help="rows per rank")
    ap.add_argument("--group", type=int, default=4, help="rows per prompt group (a group moves whole)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    args = ap.parse_args()
    rows, worst = [], {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for balance in (False, True):
                res = _run(args.ranks, args.rows, balance, seed, args.group, f"{tmp}/{seed}{balance}")
                tok, cpu = _ratio([r["tokens"] for r in res]), _ratio([r["cpu_s"] for r in res])
                worst[balance].append((tok, cpu))
                rows.append([seed, "on" if balance else "off", " / ".join(str(r["tokens"]) for r in res), f"{tok:.2f}",
                             " / ".join(f"{r['cpu_s']:.1f}" for r in res), f"{cpu:.2f}",
                             f"{max(r['wall_s'] for r in res):.1f}"])
    mean = {b: [sum(x[i] for x in v) / len(v) for i in (0, 1)] for b, v in worst.items()}
    body = (f"One update of a random tiny Qwen3 (the default's dims) on {args.ranks} gloo ranks (FSDP2), each with "
            f"{args.rows} rows ({args.group} a group) of an 8-token prompt + a long-tailed response of 64–4,096 "
            "tokens (each seed, each rank its own draw); tokens and CPU seconds (time.process_time: computing, not "
            "waiting) per rank, slowest ÷ mean; off and on side by side per seed\n\n"
            + table(["seed", "optim.balance_rows", "tokens per rank", "tokens slowest/mean", "CPU s per rank",
                     "CPU slowest/mean", "update wall s"], rows)
            + f"\n\nMean over the seeds — tokens slowest/mean: off {mean[False][0]:.2f}, on {mean[True][0]:.2f}; CPU "
            f"slowest/mean: off {mean[False][1]:.2f}, on {mean[True][1]:.2f}.")
    print(body)
    append_results("token-balanced rows across data-parallel ranks (benchmarks/balance.py)", body)


if __name__ == "__main__":
    main()
