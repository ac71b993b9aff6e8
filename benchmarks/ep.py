"""Expert parallelism on 4 gloo processes (issue 30, item 2 targets): the MoE step of `configs/moe.yaml`
with each layer's experts split over ep = 4 and ep = 2 (× 2 replicas) against the same model with every
expert on every rank (ep = 1: FSDP2 over all four, experts all-gathered like any weight) — side by side in
one run; per mode the median step time, the forward all-to-all's share of it (dispatch + combine + counts;
the backward's mirror exchange is not timed, so the share of the whole step is about twice it) and a short
learning curve (reward, and with --eval the held-out exact match) from the same seed. Modes: ``N`` is
ep = N; ``tp2`` tensor parallelism 2 × dp 2 with every expert on every rank; ``ep2xtp2`` both (the TP engine
serving each group).

    .venv/bin/python benchmarks/ep.py --steps 60
    .venv/bin/python benchmarks/ep.py --steps 200 --modes 1 2 tp2 ep2xtp2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import append_results, table  # noqa: E402

from tests.dist_helpers import run_gloo  # noqa: E402


def _dims(mode: str) -> tuple[int, int]:
    """``"4"`` → (ep 4, tp 1); ``"tp2"`` → (1, 2); ``"ep2xtp2"`` → (2, 2)."""
    ep, _, tp = mode.removeprefix("ep").partition("tp")
    ep = ep.rstrip("x")
    return int(ep or 1), int(tp or 1)


def _worker(rank, world, out_dir, mode, steps, warm, evals):
    import torch  # noqa: F401

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.distributed.expert_parallel import ExpertParallelExperts

    ep, tp = _dims(mode)
    extra = [f"--run.tp={tp}", f"--rollout.engine={{name: transformers, tp: {tp}}}"] if tp > 1 else []
    tr = build_trainer(load_config("configs/moe.yaml", [f"--run.out_dir={out_dir}", f"--run.ep={ep}", *extra,
                                                        "--run.eval_every=0", "--run.threads=1"]))
    times, comm, rewards, held = [], [], [], {}
    for s in range(1, steps + 1):
        c0, t0 = ExpertParallelExperts.comm_seconds, time.perf_counter()
        m = tr.step()
        times.append(time.perf_counter() - t0)
        comm.append(ExpertParallelExperts.comm_seconds - c0)
        rewards.append(m["reward_mean"])
        if evals and s % evals == 0:
            held[s] = tr.evaluate()["eval_reward_exact_answer_mean"]
    tr.close()
    return {"times": times[warm:], "comm": comm[warm:], "rewards": rewards, "held": held}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--eval", type=int, default=0, help="held-out evaluation every N steps (0: none)")
    p.add_argument("--modes", nargs="+", default=["1", "2", "4"], help="ep sizes, tpT, epExtpT (the first is the base)")
    args = p.parse_args()
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            ep, tp = _dims(mode)
            t0 = time.perf_counter()
            res = run_gloo(_worker, 4, f"{tmp}/{mode}", mode, args.steps, args.warm, args.eval, timeout=7200)
            wall = time.perf_counter() - t0
            step = statistics.median(max(r["times"][i] for r in res.values()) for i in range(len(res[0]["times"])))
            comm = statistics.median(statistics.fmean(r["comm"][i] for r in res.values())
                                     for i in range(len(res[0]["comm"])))
            base = step if base is None else base
            r = res[0]["rewards"]
            k = max(1, min(20, len(r) // 3))
            rows.append([ep, tp, step, step / base, comm / step if ep > 1 else 0.0,
                         statistics.fmean(r[:k]), statistics.fmean(r[-k:]),
                         " ".join(f"{v:.3f}" for v in res[0]["held"].values()) or "—", wall])
    body = ("4 gloo processes on this machine's 2 cores (oversubscribed alike in every mode), `configs/moe.yaml` "
            f"(8 experts, top-2, 32 prompts × 16 samples a step over the 4 ranks), {args.steps} steps, the first "
            f"{args.warm} not timed; step = the slowest rank's, median; all-to-all = the forward's exchanges "
            f"(the backward mirrors them); reward first/last = mean over the first/last {k} steps:\n\n")
    body += table(["ep", "tp", "s/step", f"vs {args.modes[0]}", "fwd all-to-all share", "reward first", "reward last",
                   "held-out exact", "wall s"], rows)
    append_results(f"expert parallelism: modes {' vs '.join(args.modes)} (ep = 1: experts on every rank), 4 gloo "
                   "processes", body)


if __name__ == "__main__":
    main()
