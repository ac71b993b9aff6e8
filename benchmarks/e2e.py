"""End-to-end: hyperrl's SyncTrainer vs TRL's GRPOTrainer on the default task, side by side.

Same tiny Qwen3 (random init, same seed), same character tokenizer (wrapped as an HF fast
tokenizer for TRL), same (a+b) mod 10 prompts, the same prompts × completions per step as
hyperrl's default config, one-token completions, lr 1e-3, β = 0, temperature 1; TRL otherwise
with its defaults (hyperrl with its: entropy bonus 0.05, clip-higher 0.28). Reports seconds per
step, tokens/s and the reward reached; appends to benchmarks/RESULTS.md.

    python benchmarks/e2e.py --steps 200      # needs the bench extra (trl)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402
from hyperrl.config import load_config  # noqa: E402
from hyperrl.rollout import tiny_qwen3  # noqa: E402
from hyperrl.tasks import ModSumTask  # noqa: E402
from hyperrl.tokenizer import DEFAULT_ALPHABET, char_tokenizer  # noqa: E402
from hyperrl.train import build_trainer  # noqa: E402


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


DEFAULTS = load_config()  # the same batch for both: prompts × group size from hyperrl's default config
P, N = DEFAULTS.rollout.prompts_per_step, DEFAULTS.rollout.n


def run_hyperrl(steps: int, seed: int, *overrides: str):
    cfg = load_config(None, [f"--run.steps={steps}", f"--run.seed={seed}", "--run.out_dir=/tmp/e2e_hyperrl",
                             "--run.eval_every=0", *overrides])
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
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
    append_results("e2e", f"Default task, tiny Qwen3, {P} prompts x {N} completions/step, lr 1e-3, beta 0 "
                   "(tokens = prompt + completion tokens processed; reward = mean over the last 10% of steps):\n\n"
                   + table(["trainer", "steps", "s/step", "tokens/s", "train reward (last 10%)"], rows))


if __name__ == "__main__":
    main()
