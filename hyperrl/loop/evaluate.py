"""Held-out evaluation that runs what training runs: the task's validation prompts, the
environment (multi-turn) and the configured rewards, ``eval_n`` samples per prompt."""

from __future__ import annotations

import dataclasses

import torch

from hyperrl.errors import HyperRLError

__all__ = ["Evaluator", "EvaluationError"]


class EvaluationError(HyperRLError, ValueError):
    """A held-out evaluation that cannot run (no validation prompts); names the key to set."""


class Evaluator:
    """``evaluate(step)`` → ``eval_reward_mean`` (mean@k), ``eval_pass_at_k`` (the mean over prompts
    of the best sample's reward: pass@k for 0/1 rewards), ``eval_response_len_mean``,
    ``eval_response_clipped_frac`` (responses that hit the token budget without a stop), each reward's
    mean; multi-turn: the tool-call rate and, when the environment reports it, ``eval_success_rate``.
    ``greedy``: the answers decoded greedily (top-k 1) rather than sampled as in rollout.
    Data parallel: each rank evaluates its share of the prompts and the sums are all-reduced (exact means)."""

    def __init__(self, generator, scorer, task, parallel, *, eval_n: int, eval_prompts: int, greedy: bool = False):
        self.generator, self.scorer, self.task, self.parallel = generator, scorer, task, parallel
        self.eval_n, self.eval_prompts, self.greedy = eval_n, eval_prompts, greedy

    def _sums(self, samples) -> dict[str, float]:
        """This rank's sums over its held-out prompts (rows, rewards, best per prompt, lengths, …)."""
        sampling = self.generator.sampling(0, seed_offset=10**6)
        if self.greedy:  # top-k 1: the most likely token (the sampled distribution is the argmax's point mass)
            sampling = dataclasses.replace(sampling, top_k=1)
        batch = self.generator.generate(samples, sampling, self.eval_n)
        batch = self.scorer.score(batch, dict(enumerate(samples)))
        self.scorer.pop_extra()
        r, g = batch["reward"], batch["group_id"]
        best = torch.full((len(samples),), float("-inf")).scatter_reduce(0, g, r, "amax")
        sums = {"rows": r.numel(), "prompts": len(samples), "reward": float(r.sum()), "best": float(best.sum()),
                "len": float(batch["action_mask"].sum()), "clipped": float(self.scorer.clipped(batch).sum())}
        if "tool_calls" in batch.keys():
            sums["tool_rows"] = float((batch["tool_calls"] > 0).sum())
        if "success" in batch.keys():
            sums["success"] = float(batch["success"].sum())
        comps, app = batch["reward_components"], batch["reward_applicable"]
        if comps.shape[1] >= 1:
            for j, name in enumerate(self.scorer.names):
                sums[f"r/{name}"] = float(comps[:, j][app[:, j]].sum())
                sums[f"n/{name}"] = float(app[:, j].sum())
        return sums

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        """The held-out metrics at ``step`` (see the class doc)."""
        samples = self.parallel.shard(self.task.held_out(self.eval_prompts))
        sums = self.parallel.sum_metrics(self._sums(samples) if samples else {})
        rows, prompts = sums.get("rows", 0.0), sums.get("prompts", 0.0)
        if not rows:
            raise EvaluationError("the task returned no held-out prompts; check run.eval_prompts and the validation "
                                  "data (data.val_files), or set run.eval_every=0")
        metrics = {"step": step, "eval_reward_mean": sums["reward"] / rows,
                   "eval_pass_at_k": sums["best"] / prompts, "eval_n": self.eval_n,
                   "eval_response_len_mean": sums["len"] / rows, "eval_response_clipped_frac": sums["clipped"] / rows}
        if "tool_rows" in sums:
            metrics["eval_tool_call_rate"] = sums["tool_rows"] / rows
        if "success" in sums:
            metrics["eval_success_rate"] = sums["success"] / rows
        for key in sorted(sums):
            if key.startswith("r/") and sums[f"n/{key[2:]}"]:
                metrics[f"eval_reward_{key[2:]}_mean"] = sums[key] / sums[f"n/{key[2:]}"]
        return metrics
