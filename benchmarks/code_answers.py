"""What a trained code-task model writes (issue 50, ``configs/code.yaml``): each held-out function's greedy answer,
run against its tests in the sandbox, and how many correct answers differ from the task's reference string.

Reads runs exported by ``hyperrl train --config configs/code.yaml`` (``RUN/hf``: model and tokenizer) — e.g. those
``benchmarks/seeds.py --keep DIR`` leaves — and appends a table to RESULTS.md: per run, the held-out pass rate, the
correct answers that are not the reference string (``x*3+1`` where the task's reference is ``3*x+1``), and examples.

    python benchmarks/code_answers.py runs/code
    python benchmarks/code_answers.py /tmp/seeds/seed0 /tmp/seeds/seed1 /tmp/seeds/seed2
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402


def answers(run: Path) -> list[tuple[str, str, str, bool]]:
    """``(prompt, reference, greedy answer, passed)`` for every held-out function of the run's task."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyperrl.data.tasks import TASKS
    from hyperrl.rewards.code import code_reward
    from hyperrl.tokenizer import decode_response, encode_prompt, load_tokenizer

    cfg = json.loads((run / "config.json").read_text())
    tok = load_tokenizer(run / "hf")
    model = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    task_kwargs = {k: v for k, v in cfg["task"].items() if k != "name"}
    task = TASKS.build(cfg["task"]["name"])(tok, cfg["run"]["seed"], **task_kwargs)
    samples = task.held_out(10**6)
    outs = []
    for s in samples:
        ids = torch.tensor([encode_prompt(tok, s.prompt)])
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=cfg["rollout"]["max_new_tokens"], do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        outs.append(decode_response(tok, g[0, ids.shape[1]:].tolist()))
    fn = code_reward(prefix=samples[0].extra["prefix"], all_pass=True, workers=2, cpu_s=1, wall_s=3)
    ok = fn([s.prompt for s in samples], outs, tests=[s.extra["tests"] for s in samples])
    return [(s.prompt, s.answer, o, k == 1.0) for s, o, k in zip(samples, outs, ok)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    rows, forms = [], collections.Counter()
    for run in args.runs:
        got = answers(run)
        right = [(p, ref, a) for p, ref, a, ok in got if ok]
        novel = [(p, ref, a) for p, ref, a in right if a != ref]
        forms.update(a for _, _, a in novel)
        rows.append([str(run), len(got), round(len(right) / len(got), 3), len(novel),
                     "; ".join(f"{p} → {a} (ref {ref})" for p, ref, a in novel[:3])])
        for p, ref, a, ok in got:
            print(f"{run.name}  {p:10s} ref {ref:8s} answer {a!r:10s} {'pass' if ok else 'FAIL'}")
    body = ("Greedy held-out answers of `configs/code.yaml` runs, each run in the sandbox against its function's "
            "tests; *correct, not the reference* counts the passing answers whose text differs from the task's "
            "reference string:\n\n" + table(["run", "held-out functions", "pass rate", "correct, not the reference",
                                              "examples"], rows))
    print(body)
    append_results("code task: correct programs that differ from the reference", body)


if __name__ == "__main__":
    main()
