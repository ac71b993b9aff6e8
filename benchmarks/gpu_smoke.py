"""GPU smoke check (one command, < 10 minutes on one GPU): a Qwen3-0.6B-shaped random model (from a
config, no download: hidden 1024, 28 layers, 16 heads / 8 kv heads of 128, MLP 3072, vocab 151,936,
tied embeddings) trained for 20 GRPO steps on CUDA in bf16 (fp32 master weights and optimizer
state) with the transformers engine on the same GPU. Prints the step time split (generate /
logprob / update / publish), peak GPU memory, and the engine–trainer log-prob gap in bf16 (the
engine serves bf16 weights, the trainer computes under autocast), then appends the table to
RESULTS.md.

    .venv/bin/python benchmarks/gpu_smoke.py                 # on a CUDA machine
    .venv/bin/python benchmarks/gpu_smoke.py --device cpu --tiny --steps 3   # checks the script here
    python benchmarks/gpu_smoke.py --vllm-sleep    # + vLLM's sleep/wake around a publication (vLLM on the GPU)

``--vllm-sleep`` (issue 49) adds a step where vLLM is installed: the same model in a vLLM engine with
``sleep: 1``, device memory in use (``torch.cuda.mem_get_info``, device-wide: vLLM's workers are other processes)
sampled after each phase — awake, asleep, ``begin`` (weights woken), ``commit`` (new version loaded), KV cache
woken — for hyperrl's order and for the naive one (everything woken, then the load), peak of each appended.

``--offload`` (issue 54) adds the optimizer-offload measurement: the same model and batch shape trained a few steps
with ``optim.offload: none`` and ``cpu`` (AdamW's moments and the fp32 master in host memory,
``hyperrl.distributed.offload.HostAdamW``), each in a fresh trainer — peak device memory allocated during the
steps, the step time, and the final loss of each (equal up to the copies' rounding: none — the host runs the same
AdamW kernel in fp32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402
from hyperrl.compose import build_trainer
from hyperrl.config import load_config  # noqa: E402
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.tokenizer import char_tokenizer  # noqa: E402

QWEN3_0_6B = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151_936)
TINY = dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (to check the script on CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vllm-sleep", action="store_true", help="also measure vLLM's sleep/wake around a publication")
    ap.add_argument("--offload", action="store_true", help="also measure optim.offload none vs cpu (device memory)")
    args = ap.parse_args()
    shape = TINY if args.tiny else QWEN3_0_6B
    tok = char_tokenizer()
    ckpt = Path(tempfile.mkdtemp(prefix="hyperrl-gpu-smoke-"))
    model = tiny_qwen3(shape["vocab"], hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                       kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], intermediate=shape["intermediate"],
                       max_positions=1024)
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    params = sum(p.numel() for p in model.parameters())
    del model
    common = [f"--model.checkpoint={ckpt}", f"--run.device={args.device}", "--model.dtype=bfloat16",
              "--algo.recipe=grpo", "--rollout.prompts_per_step=16", "--rollout.n=8",
              f"--rollout.max_new_tokens={args.max_new_tokens}", "--optim.lr=1e-5", "--optim.micro_batch_tokens=8192",
              "--run.eval_every=0"]
    cfg = load_config(None, [*common, f"--run.out_dir={ckpt / 'run'}", f"--run.steps={args.steps}"])
    tr = build_trainer(cfg)
    cuda = tr.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows, t0 = [], time.perf_counter()
    for _ in range(args.steps):
        m = tr.step()
        rows.append(m)
        print(f"step {m['step']}: reward {m['reward_mean']:.3f} len {m['response_len_mean']:.1f} "
              f"gen {m.get('time_generate_s', 0):.2f}s lp {m.get('time_logprob_s', 0):.2f}s "
              f"upd {m.get('time_update_s', 0):.2f}s pub {m.get('time_publish_s', 0):.2f}s "
              f"gap max {m.get('mismatch_max_abs', float('nan')):.3e}", flush=True)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    later = rows[1:] or rows  # step 0 includes warm-up

    def med(key):
        return statistics.median(r.get(key, 0.0) for r in later)

    name = torch.cuda.get_device_name() if cuda else args.device
    body = table(["model", "params", "device", "steps", "generate s", "logprob s", "update s", "publish s",
                  "step s", "peak GiB", "gap max (median)", "gap mean (median)"],
                 [["tiny" if args.tiny else "Qwen3-0.6B-shaped", f"{params / 1e6:.0f}M", name, args.steps,
                   med("time_generate_s"), med("time_logprob_s"), med("time_update_s"), med("time_publish_s"),
                   wall / args.steps, peak, med("mismatch_max_abs"), med("mismatch_mean_abs")]])
    print(body)
    append_results(f"GPU smoke: {args.steps} GRPO steps, bf16, transformers engine on the same device "
                   "(16 prompts × 8, up to %d new tokens)" % args.max_new_tokens, body)
    if args.vllm_sleep:
        vllm_sleep_step(shape, ckpt)
    if args.offload:
        del tr
        offload_step(common, ckpt, name, "tiny" if args.tiny else "Qwen3-0.6B-shaped")


def offload_step(common: list[str], ckpt: Path, device_name: str, model_name: str, steps: int = 3) -> None:
    """``optim.offload: none`` vs ``cpu``, each a fresh trainer for ``steps`` steps: the peak device memory allocated
    during them (CUDA; ``nan`` elsewhere — on the CPU the "device" is the host), the mean step time, the last loss."""
    import gc

    cuda = torch.cuda.is_available() and "--run.device=cuda" in common
    rows = []
    for mode in ("none", "cpu"):
        tr = build_trainer(load_config(None, [*common, f"--optim.offload={mode}", f"--run.steps={steps}",
                                              f"--run.out_dir={ckpt / ('offload-' + mode)}"]))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        ms = [tr.step() for _ in range(steps)]
        dt = (time.perf_counter() - t0) / steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        held = before / 2**30 if cuda else float("nan")  # weights, optimizer state (none: on the device) …
        rows.append([model_name, device_name, mode, steps, f"{held:.2f}", f"{peak:.2f}", f"{dt:.2f}",
                     f"{ms[-1]['loss_policy']:.6f}"])
        del tr, ms
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    body = table(["model", "device", "optim.offload", "steps", "allocated after build GiB", "peak GiB", "step s",
                  "last loss"], rows)
    print(body)
    append_results("GPU smoke: optimizer state on the device vs in host memory (optim.offload)", body)


def vllm_sleep_step(shape: dict, ckpt: Path) -> None:
    """vLLM's wake-up peak: hyperrl's order (weights woken at begin, KV cache after commit) vs all woken first."""
    if not torch.cuda.is_available():
        print("--vllm-sleep: needs a CUDA GPU (vLLM's sleep mode uses its CUDA memory pool); skipped")
        return
    from hyperrl.rollout.vllm_engine import VLLMEngine

    def used() -> float:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    model_sd = tiny_qwen3(shape["vocab"], hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"],
                          kv_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                          intermediate=shape["intermediate"], max_positions=1024).state_dict()
    from hyperrl.sharding.simulate import expected_destination

    rows = []
    for order in ("hyperrl", "naive"):
        eng = VLLMEngine(ckpt, dtype="bfloat16", sleep=1, max_model_len=1024, gpu_memory_utilization=0.5)
        pieces = expected_destination(eng.layout(1), model_sd, ranks=[0])[0]  # vLLM's fused parameters
        samples = {"awake": used()}
        eng.sleep()
        samples["asleep"] = used()
        if order == "naive":  # everything back before the load: old weights and the KV cache, then the new version
            eng.llm.wake_up()
            eng._asleep = ()
        eng.begin(1)  # hyperrl: only the weights wake here
        samples["begin"] = used()
        eng.stage(pieces)
        eng.commit()  # the new version loaded, then (hyperrl) the KV cache re-allocated
        torch.cuda.synchronize()
        samples["after commit"] = used()
        rows.append([order, *(f"{v:.2f}" for v in samples.values()), f"{max(samples.values()):.2f}"])
        eng.close()
    body = table(["order", *samples.keys(), "peak GiB"], rows)
    print(body)
    append_results("GPU smoke: vLLM sleep → publish → wake, device memory in use per phase (GiB)", body)


if __name__ == "__main__":
    main()
