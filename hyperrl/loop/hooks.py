"""Hooks ``hook(event, trainer, metrics)`` — how a run is observed — and the end-of-run plot.

Events: ``"step"``, ``"eval"``, ``"checkpoint"``, ``"completions"`` (``run.log_completions``).
:func:`write_jsonl` (``metrics.jsonl``), :func:`write_completions`, :func:`progress_bar` (tqdm),
:func:`clip_warning` (responses cut off by the token budget),
:func:`tensorboard` and :func:`wandb_hook` are hooks; :func:`plot_rewards` draws
``reward_curve.png`` from ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["write_jsonl", "write_completions", "progress_bar", "clip_warning", "tensorboard", "wandb_hook",
           "plot_rewards", "eval_line", "completion_rows"]


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
    if any("reward_raw_mean" in r for r in steps):  # reward shaping: the score before it, beside the shaped
        ax.plot(*_series(steps, "reward_raw_mean"), label="train score before shaping", lw=1)
    k = evals[-1].get("eval_n", 1) if evals else 1
    ax.plot(*_series(evals, "eval_reward_mean"), "o-", label=f"held-out mean@{k}")
    if k > 1:
        ax.plot(*_series(evals, "eval_pass_at_k"), "s--", label=f"held-out pass@{k}")
    named = sorted({key for r in evals for key in r if key.startswith("eval_reward_") and key.endswith("_mean")}
                   - {"eval_reward_mean"})
    for key in named if len(named) > 1 else ():
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


def eval_line(metrics: dict) -> str:
    """``reward 1.234 (digit_credit 0.700, exact_answer 0.534)`` — each named reward when several."""
    parts = [f"{k[len('eval_reward_'):-len('_mean')]} {v:.3f}" for k, v in sorted(metrics.items())
             if k.startswith("eval_reward_") and k.endswith("_mean") and k != "eval_reward_mean"]
    parts = parts if len(parts) > 1 else []
    tail = "".join(f", {name} {metrics[k]:.3f}" for k, name in (("eval_tool_call_rate", "tool calls"),
                                                                 ("eval_success_rate", "success")) if k in metrics)
    return f"reward {metrics['eval_reward_mean']:.3f}" + (f" ({', '.join(parts)})" if parts else "") + tail


def progress_bar(total: int, start: int):
    """A tqdm bar over ``total`` steps from ``start`` and the hook that advances it (and prints
    each evaluation's line); returns ``(bar, hook)``."""
    from tqdm import tqdm

    bar = tqdm(total=total, initial=start, desc="hyperrl train", unit="step", dynamic_ncols=True)

    def hook(event, trainer, metrics):
        if event == "step":  # the postfix first, shown by update's redraw — at most every 0.1 s (tqdm's
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", v=metrics["policy_version"],  # mininterval),
                            tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)  # not twice a step (4,000 writes)
            bar.update(1)
        elif event == "eval":
            bar.write(f"step {metrics['step']}: held-out {eval_line(metrics)}")

    return bar, hook


def clip_warning(max_new_tokens: int, *, threshold: float = 0.5, window: int = 50, say=None):
    """A hook that says once (``say``: print to stderr by default) when responses keep hitting the
    token budget: the mean ``response_clipped_frac`` over ``window`` training steps (after the first
    window: a random policy rarely stops), or a held-out evaluation's ``eval_response_clipped_frac``
    after step 0, at or above ``threshold`` — a run
    whose answers are cut off by ``rollout.max_new_tokens`` learns from truncated text."""
    import sys

    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    recent: list[float] = []
    warned = False

    def hook(event, trainer, metrics):
        nonlocal warned
        frac = None
        if event == "step" and "response_clipped_frac" in metrics:
            recent.append(metrics["response_clipped_frac"])
            if len(recent) == window:
                if metrics["step"] > window:  # the first window is the untrained policy's, as at step 0
                    frac, where = sum(recent) / window, f"over steps {metrics['step'] - window + 1}–{metrics['step']}"
                recent.clear()
        elif event == "eval" and metrics.get("step", 0) > 0 and "eval_response_clipped_frac" in metrics:
            frac, where = metrics["eval_response_clipped_frac"], f"at the held-out evaluation of step {metrics['step']}"
        if frac is not None and frac >= threshold and not warned:
            warned = True
            say(f"warning: {frac:.0%} of responses hit rollout.max_new_tokens={max_new_tokens} without a stop token "
                f"{where} — they are cut off; raise rollout.max_new_tokens (response_clipped_frac in metrics.jsonl)")

    return hook


def tensorboard(out: Path):
    """A hook writing every step/eval scalar and the logged completions to ``out/tb`` (None when
    TensorBoard is not installed)."""
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


def wandb_hook(cfg):
    """A hook logging every step/eval scalar and the completions table to Weights & Biases
    (``run.wandb_project``)."""
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


def write_completions(path: Path):
    """A hook appending each step's logged completions (``run.log_completions``) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(event, trainer, metrics):
        if event == "completions":
            with path.open("a") as f:
                for row in metrics["rows"]:
                    f.write(json.dumps({"step": metrics["step"], **row}) + "\n")

    return hook


def write_jsonl(path: Path):
    """A hook appending every step / eval record — and the run's ``resume``, ``interrupt`` and ``doctor`` events
    — to ``path`` as JSON lines (a NaN or infinite number is written as null: the file stays JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(event, trainer, metrics):
        if event in ("step", "eval", "resume", "interrupt", "doctor"):
            with path.open("a") as f:
                f.write(json.dumps({"event": event, **{k: (None if isinstance(v, float) and not math.isfinite(v)
                                                           else v) for k, v in metrics.items()}}) + "\n")

    return hook


def completion_rows(batch, tokenizer, reward_names, k: int) -> list[dict]:
    """The first ``k`` rows of a step (``run.log_completions``): prompt and completion text
    (everything after the prompt, observations included), reward, each reward component, the mean
    advantage."""
    import torch

    from hyperrl.tokenizer import decode_response

    k = min(k, batch.batch_size[0])
    rows = []
    for i in range(k):
        act, n = batch["action_mask"][i], int(batch["attention_mask"][i].sum())
        p = int(act.int().argmax()) if bool(act.any()) else n
        toks = batch["tokens"][i].tolist()
        adv = batch["advantages"][i][act] if "advantages" in batch.keys() else torch.zeros(1)
        rows.append({"prompt": tokenizer.decode(toks[:p], skip_special_tokens=True),  # for reading only
                     "completion": decode_response(tokenizer, toks[p:n]), "reward": float(batch["reward"][i]),
                     "group_id": int(batch["group_id"][i]),
                     "advantage": float(adv.float().mean()) if adv.numel() else 0.0,
                     **{f"reward_{name}": float(batch["reward_components"][i, j])
                        for j, name in enumerate(reward_names)}})
    return rows
