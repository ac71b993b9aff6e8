"""End-to-end: hyperrl's SyncTrainer vs TRL's GRPOTrainer, side by side, on the first default task (modsum)
(``--shape default``), at realistic shapes (``--shape long64x4`` / ``long256x4`` / ``long512x8``) and at short prompts
where generation dominates (``--shape short32x4`` / ``short64x4`` / ``short128x4``: prompts 8–16 tokens).

Same tiny Qwen3 (random init, same seed), same character tokenizer (wrapped as an HF fast
tokenizer for TRL), same (a+b) mod 10 prompts, the same prompts × completions per step as
hyperrl's default config, one-token completions, lr 1e-3, β = 0, temperature 1; TRL otherwise
with its defaults (hyperrl with its: entropy bonus 0.1, clip-higher 0.28). Reports seconds per
step, tokens/s and the reward reached; appends to benchmarks/RESULTS.md.

    python benchmarks/e2e.py --steps 200      # needs the bench extra (trl)

Realistic shapes (:data:`SHAPES`): prompts of 64–256 tokens (uniform), responses of up to 256
tokens whose lengths come from the random policy itself (EOS sampled at each step: a geometric,
long-tailed distribution — most short, a tail at the budget), 8 samples per prompt, a Qwen3 of
hidden 256 × 4 layers or 512 × 8 layers. Both trainers run the same model (the same weights: TRL
gets hyperrl's ``build_policy``), the same prompts, the same reward and the same lengths limits;
each reports seconds per step split by phase (generate / log-prob without grad / update / the
rest), tokens/s and the train reward reached. hyperrl runs four ways: as configured (shared-prefix
forward), the plain padded forward, length-sorted micro-batches cut to their longest row
(``optim.micro_batch_tokens``) and the padding-free packed forward (``optim.pack_tokens``).

    python benchmarks/e2e.py --shape long256x4 --steps 8
    python benchmarks/e2e.py --shape long256x4 --steps 12 --variants micro --target 0.3   # time to a reward
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402
from hyperrl.compose import build_trainer
from hyperrl.config import load_config  # noqa: E402
from hyperrl.data import Sample  # noqa: E402
from hyperrl.data.tasks import ModSumTask, register_task
from hyperrl.models.policy import build_policy, build_tokenizer
from hyperrl.models.tiny import tiny_qwen3
from hyperrl.rewards.builtin import register_reward
from hyperrl.tokenizer import DEFAULT_ALPHABET, char_tokenizer, encode_prompt  # noqa: E402


def hf_char_tokenizer():
    """The character tokenizer for TRL: hyperrl's ids, no ``<bos>`` post-processor (TRL's prompts
    carry ``<bos>`` as text, so both trainers see identical prompt ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ("<pad>", "<bos>", "<eos>")
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({c: i + len(specials) for i, c in enumerate(DEFAULT_ALPHABET)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    t.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


DEFAULTS = load_config()  # the same batch for both: prompts × group size from hyperrl's default config (modsum task)
P, N = DEFAULTS.rollout.prompts_per_step, DEFAULTS.rollout.n


def run_hyperrl(steps: int, seed: int, *overrides: str):
    cfg = load_config(None, [f"--run.steps={steps}", f"--run.seed={seed}", "--run.out_dir=/tmp/e2e_hyperrl",
                             "--run.eval_every=0", "--task=modsum", "--rollout.max_new_tokens=1", *overrides])
    tr = build_trainer(cfg)
    rewards, tokens = [], 0
    t0 = time.perf_counter()
    for _ in range(steps):
        m = tr.step()
        rewards.append(m["reward_mean"])
        tokens += P * N * 6  # 5 prompt tokens + 1 completion token per rollout
    return time.perf_counter() - t0, tokens, rewards


def run_trl(steps: int, seed: int):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = char_tokenizer()
    hf_tok = hf_char_tokenizer()
    task = ModSumTask(tok, seed=seed)
    samples = [s for step in range(steps) for s in task.sample(P, step)]
    ds = Dataset.from_dict({"prompt": ["<bos>" + s.prompt for s in samples], "answer": [s.answer for s in samples]})

    def reward(completions, answer, **kw):
        return [float(c[:1] == a) for c, a in zip(completions, answer)]

    model = tiny_qwen3(tok.vocab_size, seed=seed)
    args = GRPOConfig(output_dir="/tmp/e2e_trl", per_device_train_batch_size=P * N, num_generations=N,
                      max_completion_length=1, learning_rate=1e-3, beta=0.0, temperature=1.0, max_steps=steps,
                      logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=seed,
                      shuffle_dataset=False, bf16=False, dataloader_num_workers=0)
    rewards = []

    from transformers import TrainerCallback

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=hf_tok,
                          callbacks=[Log()])
    t0 = time.perf_counter()
    trainer.train()
    return time.perf_counter() - t0, steps * P * N * 6, rewards


# ----------------------------------------------------------------------------- realistic shapes
SHAPES = {  # model dims, prompts × samples per step, prompt-length range, response budget
    "long64x4": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, prompts=16, n=8,
                     prompt=(64, 256), response=64),  # the first measurement: responses ≤ 64 (1.08× then)
    "long256x4": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, prompts=16, n=8,
                      prompt=(64, 256), response=256),
    "long512x8": dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, prompts=8, n=8,
                      prompt=(64, 256), response=256),
    # short prompts, where generation dominates (issue 53: the independent measurement's shape, 1.18–1.30× then)
    **{f"short{r}x4": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=768, prompts=16, n=8,
                           prompt=(8, 16), response=r) for r in (32, 64, 128)},
}


@register_reward("digit_frac")
def digit_frac(response: str, sample) -> float:
    """The share of the response's characters that are digits (0 for an empty response): dense,
    learnable from random weights, indifferent to the length — the lengths stay the policy's own."""
    return sum(c.isdigit() for c in response) / len(response) if response else 0.0


class LongDigitsTask:
    """Prompts of random digits, ``lo..hi`` tokens with ``<bos>`` and the closing ``=`` (uniform),
    a pure function of (seed, step); reward :func:`digit_frac`."""

    def __init__(self, tokenizer, seed: int, lo: int, hi: int):
        self.tokenizer, self.seed, self.lo, self.hi = tokenizer, seed, lo, hi
        self.rewards = (("digit_frac", digit_frac),)

    def sample(self, k: int, step: int, attempt: int = 0) -> list[Sample]:
        rng = np.random.default_rng([self.seed, step, attempt])
        lens = rng.integers(self.lo - 2, self.hi - 1, size=k)  # − <bos> − "="
        return [Sample("".join(map(str, rng.integers(0, 10, n))) + "=", "", f"long:{step}:{i}", {})
                for i, n in enumerate(lens.tolist())]

    def held_out(self, k: int) -> list[Sample]:
        return self.sample(k, 10**9)

    def limits(self):
        """Its longest prompt (``hi`` tokens); no answer to fit."""
        from hyperrl.data.incode import TaskLimits

        return TaskLimits(longest_prompt=self.hi)

    def encode(self, sample: Sample) -> list[int]:
        return encode_prompt(self.tokenizer, sample.prompt)

    def reward(self, response: str, sample: Sample) -> float:
        return digit_frac(response, sample)

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


@register_task("long_digits", produces=("reward",))
def long_digits(tokenizer, seed: int, *, lo: int = 64, hi: int = 256) -> LongDigitsTask:
    """The realistic-shape benchmark's task (prompt lengths ``lo..hi`` tokens)."""
    return LongDigitsTask(tokenizer, seed, lo, hi)


def _long_overrides(shape: dict, steps: int, seed: int) -> list[str]:
    lo, hi = shape["prompt"]
    dims = [f"--model.{k}={shape[k]}" for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate")]
    return [f"--run.steps={steps}", f"--run.seed={seed}", "--run.out_dir=/tmp/e2e_long", "--run.eval_every=0",
            "--task.name=long_digits", f"--task.lo={lo}", f"--task.hi={hi}",
            f"--rollout.prompts_per_step={shape['prompts']}",
            f"--rollout.n={shape['n']}", f"--rollout.max_new_tokens={shape['response']}", *dims]


def _phases(gen: float, lp: float, upd: float, total: float) -> list[float]:
    return [round(gen, 3), round(lp, 3), round(upd, 3), round(total - gen - lp - upd, 3), round(total, 3)]


def run_hyperrl_long(shape: dict, steps: int, seed: int, *extra: str) -> dict:
    """hyperrl's SyncTrainer at a realistic shape; the first step is a warm-up (not timed)."""
    tr = build_trainer(load_config(None, [*_long_overrides(shape, steps + 1, seed), *extra]))
    tr.step()
    ph = {"generate": 0.0, "logprob": 0.0, "update": 0.0}
    total, tokens, resp, rewards, times = 0.0, 0, [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        m = tr.step()
        times.append(time.perf_counter() - t0)
        total += times[-1]
        for k in ph:
            ph[k] += m.get(f"time_{k}_s", 0.0)
        tokens += round(m["tokens_per_s"] * sum(v for k, v in m.items() if k.startswith("time_") and k.endswith("_s")))
        resp.append(m["response_len_mean"])
        rewards.append(m["reward_mean"])
    return {"phases": _phases(ph["generate"] / steps, ph["logprob"] / steps, ph["update"] / steps, total / steps),
            "tokens_s": tokens / total, "resp": float(np.mean(resp)), "reward": rewards, "times": times}


def run_trl_long(shape: dict, steps: int, seed: int) -> dict:
    """TRL 1.16 ``GRPOTrainer`` on the same model, prompts and reward; its phases timed by wrapping
    ``_generate`` (generation), ``_get_per_token_logps_and_entropies`` without grad (log-probs) and
    ``_generate_and_score_completions`` (everything before the update: the update = the step − that)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(None, _long_overrides(shape, steps + 1, seed))
    tok = build_tokenizer(cfg)
    task = LongDigitsTask(tok, seed, *shape["prompt"])
    P, N = shape["prompts"], shape["n"]
    samples = [s for step in range(steps + 1) for s in task.sample(P, step)]
    ds = Dataset.from_dict({"prompt": ["<bos>" + s.prompt for s in samples]})

    def reward(completions, **kw):
        return [digit_frac(c, None) for c in completions]

    model = build_policy(cfg, tok)
    args = GRPOConfig(output_dir="/tmp/e2e_trl_long", per_device_train_batch_size=P * N, num_generations=N,
                      max_completion_length=shape["response"], learning_rate=cfg.optim.lr, beta=0.0, temperature=1.0,
                      max_steps=steps + 1, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=seed,
                      shuffle_dataset=False, bf16=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=hf_char_tokenizer())
    clock = {"generate": 0.0, "logprob": 0.0, "collect": 0.0}

    def timed(name, fn, only_no_grad=False):
        def wrapper(*a, **kw):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            clock[name] += time.perf_counter() - t0
            return out
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed("logprob", trainer._get_per_token_logps_and_entropies, True)
    trainer._generate_and_score_completions = timed("collect", trainer._generate_and_score_completions)
    log = {"t": [], "resp": [], "reward": [], "tokens": 0}
    snap = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            snap.update(clock, t0=time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            log["t"].append((time.perf_counter() - snap["t0"], *(clock[k] - snap[k] for k in clock)))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log["reward"].append(logs["reward"])
                log["resp"].append(logs.get("completions/mean_length", float("nan")))

    trainer.add_callback(Clock())
    trainer.train()
    t = np.array(log["t"][1:])  # the first step is a warm-up
    total, gen, lp, collect = t.mean(0)
    prompt_tokens = sum(len(task.encode(s)) for s in samples[P:]) * N
    resp_tokens = float(np.mean(log["resp"][1:])) * P * N * steps
    return {"phases": _phases(gen, lp, total - collect, total),
            "tokens_s": (prompt_tokens + resp_tokens) / t[:, 0].sum(), "resp": float(np.mean(log["resp"][1:])),
            "reward": log["reward"][1:], "times": t[:, 0].tolist()}


def time_to(r: dict, target: float):
    """Seconds of timed steps until the train reward (batch mean) first reached ``target``; None if never."""
    spent = 0.0
    for dt, rew in zip(r["times"], r["reward"]):
        spent += dt
        if rew >= target:
            return round(spent, 1)
    return None


VARIANTS = {  # hyperrl's ways at a realistic shape (--variants picks some; all by default)
    "shared": ("hyperrl SyncTrainer, whole batch (shared-prefix forward, optim.micro_batch_tokens=0)",
               ("--optim.micro_batch_tokens=0",)),
    "plain": ("hyperrl, plain padded forward (optim.shared_prefix=false, optim.micro_batch_tokens=0)",
              ("--optim.shared_prefix=false", "--optim.micro_batch_tokens=0")),
    "micro": ("hyperrl defaults: length-sorted micro-batches (optim.micro_batch_tokens=8192)", ()),
    "packed": ("hyperrl, padding-free packed forward (optim.pack_tokens=2048)", ("--optim.pack_tokens=2048",)),
}


def main_long(name: str, steps: int, seed: int, variants: list[str], target: float | None) -> None:
    shape = SHAPES[name]
    runs = [(VARIANTS[v][0], run_hyperrl_long(shape, steps, seed, *VARIANTS[v][1])) for v in variants]
    runs.append(("TRL 1.16 GRPOTrainer", run_trl_long(shape, steps, seed)))
    trl = runs[-1][1]
    # per generated token: the step's seconds over the response tokens it generated (the lengths are each policy's
    # own draw, so they differ between the trainers)
    per_token = {n: r["phases"][-1] / (shape["prompts"] * shape["n"] * r["resp"]) for n, r in runs}
    rows = [[n, *r["phases"], round(r["tokens_s"]), round(r["resp"], 1), round(float(np.mean(r["reward"][-3:])), 3),
             round(trl["phases"][-1] / r["phases"][-1], 2), round(1e3 * per_token[n], 3),
             round(per_token[runs[-1][0]] / per_token[n], 2)] for n, r in runs]
    head = ["trainer", "generate s", "log-prob s", "update s", "other s", "step s", "tokens/s", "response len",
            "train reward (last 3)", "TRL step / this step", "step ms per response token", "TRL / this per token"]
    if target is not None:  # time to a fixed reward: the timed steps' seconds until the batch mean first reached it
        head += [f"s to train reward ≥ {target}", "TRL s / this s"]
        t_trl = time_to(trl, target)
        for row, (_, r) in zip(rows, runs):
            t = time_to(r, target)
            row += [t if t is not None else "—", round(t_trl / t, 2) if t and t_trl else "—"]
    dims = ", ".join(f"{k} {shape[k]}" for k in ("hidden", "layers", "heads", "kv_heads", "intermediate"))
    append_results(f"e2e at a realistic shape ({name})",
                   f"Qwen3 {dims} (random init, fp32), {shape['prompts']} prompts × {shape['n']} samples/step, "
                   f"prompts {shape['prompt'][0]}–{shape['prompt'][1]} tokens (uniform), "
                   f"responses ≤ {shape['response']} tokens "
                   f"(the random policy's own EOS: long-tailed), reward digit_frac, lr 1e-3, β 0, temperature 1; "
                   f"mean over {steps} steps after one warm-up step (seconds per step by phase):\n\n"
                   + table(head, rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default="default", choices=["default", *SHAPES])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="realistic shapes: which of hyperrl's ways to run beside TRL")
    ap.add_argument("--target", type=float, default=None,
                    help="realistic shapes: also report the seconds until the train reward first reaches this")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.shape != "default":
        return main_long(args.shape, args.steps, args.seed, args.variants, args.target)
    t_h, tok_h, r_h = run_hyperrl(args.steps, args.seed)
    t_p, tok_p, r_p = run_hyperrl(args.steps, args.seed, "--optim.shared_prefix=false")
    t_t, tok_t, r_t = run_trl(args.steps, args.seed)

    def tail(r):
        k = max(1, len(r) // 10)
        return round(sum(r[-k:]) / k, 3)

    rows = [["hyperrl SyncTrainer", args.steps, round(t_h / args.steps, 3), round(tok_h / t_h), tail(r_h)],
            ["hyperrl, plain forward (optim.shared_prefix=false)", args.steps, round(t_p / args.steps, 3),
             round(tok_p / t_p), tail(r_p)],
            ["TRL 1.16 GRPOTrainer", args.steps, round(t_t / args.steps, 3), round(tok_t / t_t), tail(r_t)],
            ["TRL s/step / hyperrl s/step", "", round(t_t / t_h, 2), round((tok_h / t_h) / (tok_t / t_t), 2), ""],
            ["TRL s/step / hyperrl plain s/step", "", round(t_t / t_p, 2), round((tok_p / t_p) / (tok_t / t_t), 2),
             ""]]
    append_results("e2e", f"modsum task (the first default), tiny Qwen3, {P} prompts x {N} completions/step, "
                   "lr 1e-3, beta 0 "
                   "(tokens = prompt + completion tokens processed; reward = mean over the last 10% of steps):\n\n"
                   + table(["trainer", "steps", "s/step", "tokens/s", "train reward (last 10%)"], rows))


if __name__ == "__main__":
    main()
