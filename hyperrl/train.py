"""``hyperrl train``: build everything from a frozen config and run the SyncTrainer.

With no arguments: a tiny Qwen3-architecture model randomly initialised from a config, the
character tokenizer, and the in-code ``arith`` task (two-digit sums, held-out operand pairs) — it
learns on 2 CPU cores in minutes.
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
from .device import pick_device, torch_dtype
from .parallel import make_parallel
from .recipes import build_pipeline
from .rewards import build_rewards
from .rollout import tiny_qwen3
from .rollout.engines import ENGINES, EngineContext
from .tasks import make_task
from .tokenizer import char_tokenizer, check_vocab, load_tokenizer
from .trainer import SyncTrainer, write_completions, write_jsonl

__all__ = ["build_trainer", "build_tokenizer", "build_policy", "train", "plot_rewards", "init_distributed"]


def _tiny(cfg: TrainConfig, tok, seed: int):
    m = cfg.model
    return tiny_qwen3(len(tok), hidden=m.hidden, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
                      head_dim=m.head_dim, intermediate=m.intermediate, seed=seed, pad_id=tok.pad_token_id,
                      bos_id=tok.bos_token_id, eos_id=tok.eos_token_id)


def build_tokenizer(cfg: TrainConfig):
    """The model's own tokenizer (``model.tokenizer``, else the checkpoint's directory), or the
    embedded character tokenizer for the random-init default."""
    src = cfg.model.tokenizer or cfg.model.checkpoint
    return load_tokenizer(src) if src else char_tokenizer()


def build_policy(cfg: TrainConfig, tok, *, seed_offset: int = 0, lora: bool = True):
    """The causal LM: ``model.checkpoint`` (local HF directory) or a tiny random Qwen3 sized to the
    tokenizer, in ``model.param_dtype``, with ``model.lora`` adapters when configured (and
    ``lora``). A tokenizer with ids the model cannot embed is an error."""
    m, dt = cfg.model, torch_dtype(cfg.model.param_dtype)
    if m.checkpoint:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(m.checkpoint, dtype=dt)
        check_vocab(tok, policy.config.vocab_size, "model.checkpoint")
    else:
        policy = _tiny(cfg, tok, cfg.run.seed + seed_offset).to(dt)
    if lora and m.lora is not None:
        from .lora import apply_lora

        policy = apply_lora(policy, **m.lora.model_dump())
    return policy


def _critic(cfg: TrainConfig, tok, hidden: int):
    """The critic: the checkpoint's backbone (verl initialises the critic from the actor's model) or
    a tiny random one, with a zero-initialised value head."""
    from .trainer import ValueModel

    backbone = build_policy(cfg, tok, seed_offset=1, lora=False).model
    return ValueModel(backbone, hidden).to(torch_dtype(cfg.model.param_dtype))


def build_trainer(cfg: TrainConfig, hooks=(), *, trainer: type | None = None, **trainer_kwargs) -> SyncTrainer:
    """Everything a config names, built once it has been checked (:func:`hyperrl.config.load_config`):
    the pipeline first (what it needs decides the rest), then the tokenizer, the policy on
    ``run.device``, the engine, a reference model when the pipeline needs ``ref_logprobs``, a
    critic when it needs ``values``, the task and the environment. Every module, buffer and (once
    the trainer makes it) optimizer state lives on the device: fp32 master weights
    (``model.param_dtype``), compute in ``model.dtype``. ``trainer`` / ``trainer_kwargs``: another
    loop over the same pieces (default: ``AsyncTrainer`` when ``async.max_staleness`` is set)."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    pipeline = build_pipeline(cfg.algo)
    device, m = pick_device(cfg.run.device), cfg.model
    dtype = torch_dtype(m.dtype)
    tok = build_tokenizer(cfg)
    task = make_task(cfg.task, tok, cfg.run.seed)
    need = getattr(task, "response_tokens", 0)
    if cfg.rollout.max_new_tokens < need:  # multi-turn too: the answer turn needs the room
        raise ValueError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: task {cfg.task.name!r} has answers "
                         f"of up to {need - 1} tokens + EOS; set rollout.max_new_tokens ≥ {need}")
    policy = build_policy(cfg, tok, lora=False).to(device)
    policy.train()
    eng = cfg.rollout.engine
    ctx = EngineContext(policy=policy, device=device, dtype=dtype, seed=cfg.run.seed, out_dir=cfg.run.out_dir,
                        tokenizer=tok, lora=m.lora.model_dump() if m.lora is not None else None)
    engine = ENGINES.build(eng.name, **eng.args)(ctx)  # from the base weights (= the LoRA model at init: B = 0)
    reference = None
    if m.lora is not None:
        from .lora import AdapterDisabled, apply_lora

        policy = apply_lora(policy, **m.lora.model_dump())
        if "ref_logprobs" in pipeline.needs:  # the base itself: adapters disabled, no copy
            reference = AdapterDisabled(policy)
    elif "ref_logprobs" in pipeline.needs:  # frozen: kept in the compute dtype (no optimizer, no master copy)
        reference = copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)
    critic = _critic(cfg, tok, policy.config.hidden_size).to(device) if "values" in pipeline.needs else None
    if m.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    parallel = make_parallel(cfg.run.tp)
    if cfg.optim.pack_tokens and parallel.world > 1:
        raise ValueError(f"optim.pack_tokens={cfg.optim.pack_tokens}: the packed forward makes a data-dependent number "
                         f"of model calls, which {parallel.world} FSDP ranks cannot keep in step; set "
                         "optim.pack_tokens=0 (or run one process)")
    if cfg.run.tp > 1:
        if critic is not None:
            raise ValueError(f"run.tp={cfg.run.tp}: a critic (algo.advantage={cfg.algo.advantage.name!r}) is not "
                             f"tensor-parallel yet; use run.tp=1 or an advantage without values (grpo, rloo, …)")
        policy = _tensor_parallel(policy, cfg.run.tp, device, dtype)
        from .parallelize import tp_partial_params

        parallel.sum_over_tp(tp_partial_params(policy))
    elif parallel.world > 1:
        if m.lora is None:
            policy = _fully_shard(policy, policy.model.layers, device, dtype)
        else:  # the frozen base replicated, the adapters' gradients all-reduced (parallel.sync_grads)
            parallel.replicate(policy)
        if critic is not None:
            critic = _fully_shard(critic, critic.backbone.layers, device, dtype)
    if m.compile and getattr(engine, "shared", False):
        raise ValueError("model.compile with rollout.engine.share_weights: the engine would decode through the "
                         "compiled training forward; set share_weights: false")
    if m.compile:  # last: the engine's and the reference's copies must not share the compiled forward
        policy.compile(backend=m.compile, dynamic=True)
    make_env = None
    if cfg.env is not None:
        from .envs import ENVIRONMENTS

        make_env = ENVIRONMENTS.build(cfg.env.name, **cfg.env.args)
    rewards = build_rewards(cfg.rewards) if cfg.rewards else None
    if trainer is None:  # async.max_staleness set: the asynchronous loop over the same pieces
        trainer = SyncTrainer
        if getattr(cfg, "async").max_staleness is not None:  # the AsyncTrainer reads the rest of the section
            from .async_trainer import AsyncTrainer

            trainer = AsyncTrainer
    return trainer(cfg, policy=policy, engine=engine, tokenizer=tok, task=task, pipeline=pipeline, hooks=hooks,
                   reference=reference, critic=critic, make_env=make_env, rewards=rewards, parallel=parallel,
                   **trainer_kwargs)


def _fully_shard(module, layers, device: torch.device, dtype: torch.dtype):
    """FSDP2 over all ranks on a device mesh of the run's device type (gloo on CPU, NCCL/HCCL on
    devices): each decoder layer, then the root. Mixed precision by FSDP2's
    ``MixedPrecisionPolicy``: parameters all-gathered and computed in ``dtype``, gradients
    reduced in fp32 (the sharded master weights and the optimizer state stay in
    ``model.param_dtype``). FSDP averages gradients over ranks; the trainer scales each loss by the
    world size so the result is the *sum* the global token normaliser expects (gloo has no
    PREMUL_SUM for a divide factor of 1), keeping accumulation exact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),), mesh_dim_names=("fsdp",))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    return module


def _tensor_parallel(module, tp: int, device: torch.device, dtype: torch.dtype):
    """TP over groups of ``tp`` consecutive ranks and FSDP2 over the ``world / tp`` data-parallel
    groups, on a ``(dp, tp)`` device mesh — the model family's plan (:mod:`hyperrl.parallelize`),
    mixed precision as in :func:`_fully_shard`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .parallelize import parallelize

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return parallelize(module, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    got = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [s for s, _ in got], [v for _, v in got]


def plot_rewards(jsonl: Path, png: Path) -> dict[str, list[str]]:
    """What a run shows, one panel each: train and held-out reward (mean@k, and pass@k when
    ``run.eval_n`` > 1; each named reward's held-out mean when there are several), the policy's
    entropy, response length (train and held-out) and — in multi-turn runs — the tool-call rate and,
    when the environment reports it, the success rate.
    Returns each panel's title → the labels of the series drawn in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r["event"] == "step"]
    evals = [r for r in rows if r["event"] == "eval"]
    tools = any("tool_call_rate" in r for r in steps)
    fig, axes = plt.subplots(1, 4 if tools else 3, figsize=(16 if tools else 13, 3.8))
    ax = axes[0]
    ax.plot(*_series(steps, "reward_mean"), label="train reward (batch mean)", lw=1)
    k = evals[-1].get("eval_n", 1) if evals else 1
    ax.plot(*_series(evals, "eval_reward_mean"), "o-", label=f"held-out mean@{k}")
    if k > 1:
        ax.plot(*_series(evals, "eval_pass_at_k"), "s--", label=f"held-out pass@{k}")
    for key in sorted({key for r in evals for key in r if key.startswith("eval_reward_") and key.endswith("_mean")}
                      - {"eval_reward_mean"}):
        ax.plot(*_series(evals, key), ".:", label=f"held-out {key[len('eval_reward_'):-len('_mean')]}")
    ax.set_title("reward")
    panels = [(axes[1], "entropy", [("entropy", "train (action tokens)")]),
              (axes[2], "response length (tokens)", [("response_len_mean", "train"),
                                                     ("eval_response_len_mean", "held-out")])]
    if tools:
        panels.append((axes[3], "tool calls and success", [
            ("tool_call_rate", "tool-call rate (train)"), ("eval_tool_call_rate", "tool-call rate (held-out)"),
            ("success_rate", "success (train)"), ("eval_success_rate", "success (held-out)")]))
    for a, title, keys in panels:
        for key, label in keys:
            src = evals if key.startswith("eval_") else steps
            xs, ys = _series(src, key)
            if xs:  # a series the run does not report (success without an environment verdict) is not drawn
                a.plot(xs, ys, "o-" if src is evals else "-", lw=1, label=label)
        a.set_title(title)
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    drawn = {a.get_title(): a.get_legend_handles_labels()[1] for a in axes}
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return drawn


def _eval_line(metrics: dict) -> str:
    """``reward 1.234 (digit_credit 0.700, exact_answer 0.534)`` — each named reward when several."""
    parts = [f"{k[len('eval_reward_'):-len('_mean')]} {v:.3f}" for k, v in sorted(metrics.items())
             if k.startswith("eval_reward_") and k.endswith("_mean") and k != "eval_reward_mean"]
    tail = "".join(f", {name} {metrics[k]:.3f}" for k, name in (("eval_tool_call_rate", "tool calls"),
                                                                 ("eval_success_rate", "success")) if k in metrics)
    return f"reward {metrics['eval_reward_mean']:.3f}" + (f" ({', '.join(parts)})" if parts else "") + tail


def _progress(total: int, start: int):
    from tqdm import tqdm

    bar = tqdm(total=total, initial=start, desc="hyperrl train", unit="step", dynamic_ncols=True)

    def hook(event, trainer, metrics):
        if event == "step":
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", v=metrics["policy_version"],
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
        elif event == "eval":
            bar.write(f"step {metrics['step']}: held-out {_eval_line(metrics)}")

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
        elif event == "completions":
            text = "\n\n".join(f"**reward {r['reward']:.3f}** (adv {r['advantage']:+.3f})  \n`{r['prompt']}` → "
                                f"`{r['completion']}`" for r in metrics["rows"])
            writer.add_text("completions", text, metrics["step"])

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
        elif event == "completions" and metrics["rows"]:
            cols = list(metrics["rows"][0])
            run.log({"completions": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in metrics["rows"]])},
                    step=metrics["step"])

    return hook


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
    jsonl = out / "metrics.jsonl"
    trainer = build_trainer(cfg)  # first: bad data, tokenizers or rewards fail before anything is written
    out.mkdir(parents=True, exist_ok=True)
    hooks = list(extra_hooks)
    if rank == 0:  # rank 0 logs; metrics are already averaged over ranks
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        hooks.append(write_jsonl(jsonl))
        if cfg.run.log_completions:
            hooks.append(write_completions(out / "completions.jsonl"))
        tb = _tensorboard(out)
        if tb:
            hooks.append(tb)
        if cfg.run.wandb_project:
            hooks.append(_wandb(cfg))
    trainer.hooks.extend(hooks)
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
        bar, hook = _progress(cfg.run.steps, trainer.step_idx)
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
    getattr(trainer, "close", lambda: None)()  # an asynchronous run's rollout worker
    if rank == 0:
        plot_rewards(jsonl, out / "reward_curve.png")
        if cfg.run.export:
            from .export import export_hf

            export_hf(ckpt, out / "hf")
    summary = {"out_dir": str(out), "steps": trainer.step_idx, "seconds": time.perf_counter() - t0,
               "final_eval_reward": last_eval["eval_reward_mean"] if last_eval else None,
               "final_eval": _eval_line(last_eval) if last_eval else None,
               "policy_version": trainer.version, "export": str(out / "hf") if cfg.run.export else None}
    return summary
