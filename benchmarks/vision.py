"""Vision-language RL on CPU (issue 32's targets), two measurements:

``--what trl`` — seconds per step of the visual task (configs/vision.yaml: the tiny random Qwen2.5-VL, the
``shapes`` boards, 32 prompts × 16 samples, answers of one character + EOS) in hyperrl's SyncTrainer and in TRL
1.16's ``GRPOTrainer`` (VLM GRPO), side by side in one run: the same model (TRL gets hyperrl's ``build_policy`` —
the same weights, the same suppressed vision tokens), the same boards and questions, the same tokens (TRL renders
``{"type": "image"}`` parts with a chat template writing Qwen-VL's vision tokens, its processor expands them to the
image's grid as hyperrl does), the same image processor, the same batch, lr and temperature, β = 0. TRL's processor
is transformers' ``Qwen2_5_VLProcessor`` without a video processor (transformers 5's needs torchvision, which is not
installed beside the CPU torch; no video is used).

``--what memory`` — the update's peak RSS (prepare + update, after the rollout; the kernel's peak counter reset
through ``/proc/self/clear_refs`` first) against the number of images per step at a fixed micro-batch budget
(``optim.micro_batch_tokens``: tokens plus image patches), each in a fresh process: the rows of a step grow, the
update's memory should not.

    python benchmarks/vision.py --what trl --steps 20
    python benchmarks/vision.py --what memory --prompts 8 32 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, run_child, table  # noqa: E402

CONFIG = ROOT / "configs" / "vision.yaml"
# Qwen-VL's rendering of an image part (what hyperrl's shapes prompt writes) and of text parts
TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")


def _cfg(steps: int, seed: int, out: str, *extra: str):
    from hyperrl.config import load_config

    return load_config(CONFIG, [f"--run.steps={steps}", f"--run.seed={seed}", f"--run.out_dir={out}",
                                "--run.eval_every=0", *extra])


def run_hyperrl(steps: int, seed: int) -> dict:
    from hyperrl.compose import build_trainer

    tr = build_trainer(_cfg(steps + 1, seed, "/tmp/vision_bench_hyperrl"))
    tr.step()  # warm-up
    t0, rewards = time.perf_counter(), []
    for _ in range(steps):
        rewards.append(tr.step()["reward_exact_answer_mean"])
    return {"s": (time.perf_counter() - t0) / steps, "reward": sum(rewards) / len(rewards)}


def run_trl(steps: int, seed: int, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import Qwen2_5_VLProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hyperrl.data.tasks import make_task
    from hyperrl.data.visual import IMAGE_PROMPT, draw_board
    from hyperrl.models.policy import build_image_processor, build_policy, build_tokenizer

    cfg = _cfg(steps + 1, seed, "/tmp/vision_bench_trl")
    tok = build_tokenizer(cfg)
    model = build_policy(cfg, tok)
    processor_images = build_image_processor(cfg)
    task = make_task(cfg.task, tok, cfg.run.seed, processor_images)
    P, N = cfg.rollout.prompts_per_step, cfg.rollout.n

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):  # no video processor: it needs torchvision (see the module doc)
        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(
                name, arg)

    proc = ImageOnlyProcessor(image_processor=processor_images, tokenizer=tok, video_processor=None,
                              chat_template=TEMPLATE)
    samples = [s for step in range(steps + 1) for s in task.sample(P, step)]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": s.prompt[len(IMAGE_PROMPT):]}]}],
        "image": draw_board(tuple(s.extra["board"]), task.grid, task.cell), "idx": i} for i, s in enumerate(samples)])
    # the same prompt tokens as hyperrl's (<bos>, the vision tokens expanded to the image's grid, the question)
    first = proc(text=[proc.apply_chat_template(ds[0]["prompt"], tokenize=False)], images=[ds[0]["image"]])
    assert list(first["input_ids"][0]) == task.encode(samples[0]), "TRL's prompt tokens differ from hyperrl's"

    def rewarder(fn):  # hyperrl's reward functions of the config (digit_match, exact_answer), summed by TRL as here
        def reward(completions, idx, **kw):
            texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]  # conversational: a turn
            return [float(fn(c, samples[i])) for c, i in zip(texts, idx)]

        reward.__name__ = fn.__name__
        return reward

    args = GRPOConfig(output_dir="/tmp/vision_bench_trl", per_device_train_batch_size=P * N, num_generations=N,
                      max_completion_length=cfg.rollout.max_new_tokens, learning_rate=cfg.optim.lr, beta=0.0,
                      temperature=cfg.rollout.temperature, max_steps=steps + 1, logging_steps=1, report_to=[],
                      use_cpu=True, save_strategy="no", seed=seed, shuffle_dataset=False, bf16=False,
                      dataloader_num_workers=0)
    times, rewards = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            key = "rewards/exact_answer/mean"
            if logs and key in logs:
                rewards.append(logs[key])

    torch.set_num_threads(threads)
    GRPOTrainer(model=model, reward_funcs=[rewarder(fn) for _, fn in task.rewards], args=args, train_dataset=ds,
                processing_class=proc, callbacks=[Clock()]).train()
    return {"s": sum(times[1:]) / len(times[1:]), "reward": sum(rewards[1:]) / max(len(rewards[1:]), 1)}


_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from benchmarks.vision import _cfg
from hyperrl.compose import build_trainer
from hyperrl.loop.collect import Timer
prompts, budget, cell = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tr = build_trainer(_cfg(1, 0, "/tmp/vision_bench_mem", f"--rollout.prompts_per_step={prompts}", "--rollout.n=8",
                        f"--optim.micro_batch_tokens={budget}", f"--task.cell={cell}", "--algo.gate_threshold=1e9"))
batch = tr.collect(Timer()).batch
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) / 1024
rows, patches = batch.batch_size[0], int(batch["pixel_values"].shape[1])
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
before = status("VmRSS")
batch, _ = tr.prepare(batch)
batch = tr.pipeline.transform(batch)
tr.update(batch)
print(json.dumps({"rows": rows, "patches": patches, "before_mib": before, "peak_mib": status("VmHWM")}))
"""


def run_memory(prompts: int, budget: int, cell: int) -> dict:
    return run_child(_CHILD, ROOT, prompts, budget, cell, cwd=ROOT)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", choices=["trl", "memory"], required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 32, 128], help="memory: prompts per step (× 8)")
    ap.add_argument("--budget", type=int, default=256, help="memory: optim.micro_batch_tokens (tokens + patches)")
    ap.add_argument("--cell", type=int, default=28, help="memory: the board's cell in pixels (28: 16 patches)")
    args = ap.parse_args()
    if args.what == "trl":
        h = run_hyperrl(args.steps, args.seed)  # run.threads 1 (configs/vision.yaml): its fastest here
        trl = {k: run_trl(args.steps, args.seed, k) for k in (1, 2)}  # TRL at both: its faster one is compared
        best = min(trl, key=lambda k: trl[k]["s"])
        rows = [["hyperrl SyncTrainer (1 thread)", round(h["s"], 3), round(h["reward"], 3)]]
        for k, t in trl.items():
            rows.append([f"TRL 1.16 GRPOTrainer ({k} thread{'s' * (k > 1)})", round(t["s"], 3), round(t["reward"], 3)])
        ratio = round(trl[best]["s"] / h["s"], 2)
        rows.append([f"TRL s/step ({best} thread{'s' * (best > 1)}) / hyperrl s/step", ratio, ""])
        append_results("vision-language RL: hyperrl vs TRL GRPOTrainer (issue 32)",
                       "configs/vision.yaml (tiny random Qwen2.5-VL, shapes boards, 32 prompts × 16, one character + "
                       "EOS), both trainers on the same model, boards, tokens, image processor and reward functions "
                       "(digit_match + exact_answer), lr 5e-4, β = 0; mean seconds per step over "
                       f"{args.steps} steps after one warm-up step, and the mean train exact-answer reward over "
                       "them:\n\n" + table(["trainer", "s/step", "train exact"], rows))
        return
    res = [run_memory(p, args.budget, args.cell) for p in args.prompts]
    rows = [[p, r["rows"], r["rows"], r["patches"], round(r["before_mib"]), round(r["peak_mib"]),
             round(r["peak_mib"] - r["before_mib"])] for p, r in zip(args.prompts, res)]
    append_results("vision-language RL: the update's peak RSS vs images per step (issue 32)",
                   f"configs/vision.yaml with task.cell={args.cell} (each image {res[0]['patches']} patches), "
                   f"8 samples per prompt (one image each), `optim.micro_batch_tokens={args.budget}` (tokens + "
                   "patches); prepare + update after the rollout, peak RSS (VmHWM reset before) in a fresh "
                   "process each:\n\n"
                   + table(["prompts", "rows", "images", "patches / image", "RSS before MiB", "peak MiB",
                            "update's own MiB"], rows))


if __name__ == "__main__":
    main()
