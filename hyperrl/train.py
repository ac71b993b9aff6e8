"""``hyperrl train``: build everything from a frozen config and run the SyncTrainer.

With no arguments: a tiny Qwen3-architecture model randomly initialised from a config, the
character tokenizer, and the in-code ``modsum`` task — it learns on 2 CPU cores in minutes.
Outputs in ``run.out_dir``: ``metrics.jsonl``, ``reward_curve.png``, ``config.json``,
``checkpoints/step_<k>/``.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from .config import TrainConfig
from .recipes import build_pipeline
from .rollout import tiny_qwen3
from .rollout.engines import ENGINES
from .tasks import make_task
from .tokenizer import CharTokenizer
from .trainer import SyncTrainer, write_jsonl

__all__ = ["build_trainer", "train", "plot_rewards", "init_distributed"]


def _tiny(cfg: TrainConfig, tok: CharTokenizer, seed: int):
    m = cfg.model
    return tiny_qwen3(tok.vocab_size, hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                      head_dim=m.head_dim, intermediate=m.intermediate, seed=seed)


def build_trainer(cfg: TrainConfig, hooks=()) -> SyncTrainer:
    """Everything a config names, built once it has been checked (:func:`hyperrl.config.load_config`):
    the pipeline first (what it needs decides the rest), then the policy, the engine, a reference
    model when the pipeline needs ``ref_logprobs``, a critic when it needs ``values``, the task and
    the environment."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    pipeline = build_pipeline(cfg.algo)
    tok = CharTokenizer()
    m = cfg.model
    if m.checkpoint:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(m.checkpoint, torch_dtype=torch.float32)
        if policy.config.vocab_size < tok.vocab_size:
            raise ValueError(f"model.checkpoint: vocab {policy.config.vocab_size} < tokenizer {tok.vocab_size}")
    else:
        policy = _tiny(cfg, tok, cfg.run.seed)
    policy.train()
    eng = cfg.rollout.engine
    engine = ENGINES.build(eng.name, **eng.args)(policy, cfg.run.device, cfg.run.seed, cfg.run.out_dir)
    reference = copy.deepcopy(policy).eval() if "ref_logprobs" in pipeline.needs else None
    critic = None
    if "values" in pipeline.needs:
        from .trainer import ValueModel

        critic = ValueModel(_tiny(cfg, tok, cfg.run.seed + 1).model, policy.config.hidden_size)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        policy = _fully_shard(policy, policy.model.layers)
        if critic is not None:
            critic = _fully_shard(critic, critic.backbone.layers)
    task = make_task(cfg.task, tok, cfg.run.seed)
    make_env = None
    if cfg.env is not None:
        from .envs import ENVIRONMENTS

        make_env = ENVIRONMENTS.build(cfg.env.name, **cfg.env.args)
    return SyncTrainer(cfg, policy=policy, engine=engine, tokenizer=tok, task=task, pipeline=pipeline, hooks=hooks,
                       reference=reference, critic=critic, make_env=make_env)


def _fully_shard(module, layers):
    """FSDP2 over all ranks (gloo on CPU, NCCL/HCCL on devices): each decoder layer, then the root.
    FSDP averages gradients over ranks; the trainer scales each loss by the world size so the
    result is the *sum* the global token normaliser expects (gloo has no PREMUL_SUM for a divide
    factor of 1), keeping accumulation exact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def plot_rewards(jsonl: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r["event"] == "step"]
    evals = [r for r in rows if r["event"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="train reward (batch mean)", lw=1)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_reward_mean"] for r in evals], "o-", label="held-out reward")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _progress(total: int, start: int):
    from tqdm import tqdm

    bar = tqdm(total=total, initial=start, desc="hyperrl train", unit="step", dynamic_ncols=True)

    def hook(event, trainer, metrics):
        if event == "step":
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", v=metrics["policy_version"],
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
        elif event == "eval":
            bar.write(f"step {metrics['step']}: held-out reward {metrics['eval_reward_mean']:.3f}")

    return bar, hook


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # noqa: BLE001 - TensorBoard is optional
        return None
    writer = SummaryWriter(str(out / "tb"))

    def hook(event, trainer, metrics):
        if event in ("step", "eval"):
            for k, v in metrics.items():
                if isinstance(v, int | float) and k != "step":
                    writer.add_scalar(k, v, metrics["step"])

    return hook


def _wandb(cfg: TrainConfig):
    try:
        import wandb
    except ImportError:
        raise ValueError(f"run.wandb_project={cfg.run.wandb_project!r} needs wandb: `pip install wandb`, or unset "
                         "run.wandb_project") from None
    run = wandb.init(project=cfg.run.wandb_project, config=cfg.to_dict(), dir=cfg.run.out_dir)

    def hook(event, trainer, metrics):
        if event in ("step", "eval"):
            run.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=metrics["step"])

    return hook


def _truncate_log(jsonl: Path, step: int) -> None:
    """Drop the records a killed run logged after its last checkpoint (and a torn last line): the
    resumed run logs those steps again, so the file ends as an uninterrupted run's would."""
    if not jsonl.exists():
        return
    keep = []
    for line in jsonl.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) <= step:
            keep.append(line)
    tmp = jsonl.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep))
    tmp.replace(jsonl)


def init_distributed(device: str = "cpu") -> int:
    """Under ``torchrun`` (``WORLD_SIZE > 1``) join the process group — gloo on CPU, NCCL on CUDA,
    HCCL on NPU — and return this process's rank (0 when single-process)."""
    import os

    from .device import collective_backend, pick_device

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(collective_backend(pick_device(device)))
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def train(cfg: TrainConfig, *, resume: bool = True, progress: bool = True, extra_hooks=()) -> dict:
    rank = init_distributed(cfg.run.device)
    out = Path(cfg.run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "metrics.jsonl"
    hooks = list(extra_hooks)
    if rank == 0:  # rank 0 logs; metrics are already averaged over ranks
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        hooks.append(write_jsonl(jsonl))
        tb = _tensorboard(out)
        if tb:
            hooks.append(tb)
        if cfg.run.wandb_project:
            hooks.append(_wandb(cfg))
    trainer = build_trainer(cfg, hooks)
    if resume and trainer.resume():
        print(f"resumed from step {trainer.step_idx} (serving version {trainer.version})")
        if rank == 0:
            _truncate_log(jsonl, trainer.step_idx)
    elif jsonl.exists() and rank == 0:
        jsonl.unlink()
    bar = None
    progress = progress and rank == 0
    if progress:
        bar, hook = _progress(cfg.run.steps, trainer.step_idx)
        trainer.hooks.append(hook)
    t0 = time.perf_counter()
    last_eval = None
    if trainer.step_idx == 0 and cfg.run.eval_every:
        last_eval = trainer.evaluate()
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
    trainer.save()
    if rank == 0:
        plot_rewards(jsonl, out / "reward_curve.png")
    summary = {"out_dir": str(out), "steps": trainer.step_idx, "seconds": time.perf_counter() - t0,
               "final_eval_reward": last_eval["eval_reward_mean"] if last_eval else None,
               "policy_version": trainer.version}
    return summary
