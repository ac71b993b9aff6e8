"""``hyperrl train``: the outer loop — build from a frozen config, resume, step, evaluate, checkpoint,
plot and export.

With no arguments: a tiny Qwen3-architecture model randomly initialised from a config, the
character tokenizer, and the in-code ``arith`` task (two-digit sums, held-out operand pairs) — it
learns on 2 CPU cores in minutes.
Outputs in ``run.out_dir``: ``metrics.jsonl``, ``reward_curve.png``, ``config.json``,
``checkpoints/step_<k>/``, ``hf/``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hyperrl.compose import build
from hyperrl.config import TrainConfig
from hyperrl.distributed import init_distributed
from hyperrl.export import export_hf
from hyperrl.loop.hooks import (
    clip_warning,
    eval_line,
    plot_rewards,
    progress_bar,
    tensorboard,
    wandb_hook,
    write_completions,
    write_jsonl,
)

__all__ = ["train"]


def _truncate_log(jsonl: Path, step: int) -> None:
    """Drop the records a killed run logged after its last checkpoint (and a torn last line), and
    the evaluation at the checkpoint's own step: the resumed run logs those again (it re-evaluates at
    that step when an evaluation was due there), so the file ends as an uninterrupted run's would."""
    if not jsonl.exists():
        return
    keep = []
    for line in jsonl.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) < step or (rec.get("step", 0) == step and rec.get("event") != "eval"):
            keep.append(line)
    tmp = jsonl.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep))
    tmp.replace(jsonl)


def train(cfg: TrainConfig, *, resume: bool = True, progress: bool = True, extra_hooks=()) -> dict:
    """Run ``cfg`` to ``run.steps`` (resuming from ``run.out_dir``'s latest checkpoint when
    ``resume``): evaluations every ``run.eval_every`` steps, checkpoints every ``run.ckpt_every``
    and at the end, the reward plot and (``run.export``) the Hugging Face export. Returns a summary
    (out_dir, steps, seconds, the final evaluation, the policy version, the export directory)."""
    rank = init_distributed(cfg.run.device)
    out = Path(cfg.run.out_dir)
    jsonl = out / "metrics.jsonl"
    trainer = build(cfg)  # first: bad data, tokenizers or rewards fail before anything is written
    out.mkdir(parents=True, exist_ok=True)
    hooks = list(extra_hooks)
    if rank == 0:  # rank 0 logs; metrics are already averaged over ranks
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        hooks.append(write_jsonl(jsonl))
        hooks.append(clip_warning(cfg.rollout.max_new_tokens))
        if cfg.run.log_completions:
            hooks.append(write_completions(out / "completions.jsonl"))
        tb = tensorboard(out)
        if tb:
            hooks.append(tb)
        if cfg.run.wandb_project:
            hooks.append(wandb_hook(cfg))
    trainer.hooks.extend(hooks)
    if rank == 0 and progress:
        print(f"hyperrl train: outputs in {out}/", flush=True)
    resumed = resume and trainer.resume()
    if resumed:
        print(f"resumed from step {trainer.step_idx} (serving version {trainer.version})")
        if rank == 0:
            _truncate_log(jsonl, trainer.step_idx)
            _truncate_log(out / "completions.jsonl", trainer.step_idx)
    elif rank == 0:
        for f in (jsonl, out / "completions.jsonl"):
            f.unlink(missing_ok=True)
    bar = None
    progress = progress and rank == 0
    if progress:
        bar, hook = progress_bar(cfg.run.steps, trainer.step_idx)
        trainer.hooks.append(hook)
    t0 = time.perf_counter()
    last_eval = None
    if cfg.run.eval_every and (trainer.step_idx == 0 or (resumed and (trainer.step_idx % cfg.run.eval_every == 0 or
                                                                      trainer.step_idx >= cfg.run.steps))):
        last_eval = trainer.evaluate()  # at the start, or again at a resumed step whose evaluation was due
    while trainer.step_idx < cfg.run.steps:
        trainer.step()
        if cfg.run.eval_every and trainer.step_idx % cfg.run.eval_every == 0:
            last_eval = trainer.evaluate()
        if cfg.run.ckpt_every and trainer.step_idx % cfg.run.ckpt_every == 0:
            trainer.save()
    if bar is not None:
        bar.close()
    if cfg.run.eval_every and (last_eval is None or last_eval["step"] != trainer.step_idx):
        last_eval = trainer.evaluate()
    ckpt = trainer.save()
    trainer.close()  # an asynchronous run's rollout workers
    if rank == 0:
        plot_rewards(jsonl, out / "reward_curve.png")
        if cfg.run.export:
            export_hf(ckpt, out / "hf")
    summary = {"out_dir": str(out), "steps": trainer.step_idx, "seconds": time.perf_counter() - t0,
               "final_eval_reward": last_eval["eval_reward_mean"] if last_eval else None,
               "final_eval": eval_line(last_eval) if last_eval else None,
               "policy_version": trainer.version, "export": str(out / "hf") if cfg.run.export else None}
    return summary
