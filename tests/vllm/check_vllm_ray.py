"""vLLM engines in Ray actors (``rollout.engine=vllm`` with ``async.executor: {name: ray, workers: 2}``),
run by tests/rollout/test_vllm.py in .venv-vllm.

The learner's process never starts a vLLM engine: each actor builds its own from the saved initial
weights; the group's layout (vLLM's fused parameters) is read from the first actor and the learner's
publisher plans into it; pieces travel once through Ray's object store and each actor stages them into
its own engine (two-phase commit). An AsyncTrainer at η = 1 runs with every decode step slowed (so
publications land mid-generation: requests are aborted in vLLM and resumed from their tokens); then
one actor is killed and the run goes on (the actor is born again from the initial weights and loaded
with the current version before it serves). Reports: every sample trained once, within η; each
actor's version; each actor's log-probs of its own sampled tokens against the learner's policy.
"""

import dataclasses
import json
import sys
import tempfile
import time


def run(engine: str = "{name: vllm, enforce_eager: true}") -> dict:
    import torch

    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config
    from hyperrl.loop.forward import plain_logprobs_and_entropy
    from hyperrl.loop.trainer import AsyncTrainer
    from hyperrl.rollout.engines import EngineSpec

    built_here = []  # engines built in this (the learner's) process from a description
    build = EngineSpec.build
    EngineSpec.build = lambda self, **kw: built_here.append(self.target) or build(self, **kw)

    class Recording(AsyncTrainer):
        def collect(self, timer):
            got = super().collect(timer)
            batch = got.batch
            av = batch["token_version"][batch["action_mask"]]
            self.trained = getattr(self, "trained", []) + [(self.version, batch["sample_uid"].tolist(),
                                                            int((self.version - av).max()))]
            return got

    def slow(actor):  # every decode step 20 ms slower (only the timing changes); defined here: travels by value
        class _Slow:
            def __init__(self, inner):
                self.inner = inner

            def is_set(self):
                time.sleep(0.02)
                return self.inner.is_set()

        gen = actor.engine.generate_requests
        actor.engine.generate_requests = lambda reqs, sp, abort=None, **kw: gen(reqs, sp, abort=_Slow(abort), **kw)
        return type(actor.engine).__name__

    cfg = load_config(None, [f"--rollout.engine={engine}",
                             "--async.executor={name: ray, workers: 2, num_cpus: 1, timeout_s: 600}",
                             f"--run.out_dir={tempfile.mkdtemp()}", "--task=modsum", "--rollout.max_new_tokens=8",
                             "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.eval_every=0",
                             "--async.max_staleness=1", "--rollout.delta_publication=true"])
    try:  # the group publishes merged weights: vLLM's adapter path is refused at load, named
        load_config(None, ["--rollout.engine={name: vllm, lora_adapters: true}", "--model.lora={r: 4}",
                           "--async.executor={name: ray}", "--async.max_staleness=1"])
        refused = None
    except Exception as e:  # noqa: BLE001
        refused = str(e)
    t0 = time.perf_counter()
    tr = build_trainer(cfg, trainer=Recording)
    res = {"start_s": time.perf_counter() - t0, "group": type(tr.engine).__name__,
           "built_here": list(built_here), "lora_refused": refused,
           "layout_sample": sorted(tr.engine.layout(1).params)[:6]}
    import ray  # after the trainer started Ray (with token authentication)

    try:
        workers = tr.collector.workers
        res["actor_engines"] = ray.get([w.actor.__ray_call__.remote(slow) for w in workers])
        res["pids"] = len({w.info()["pid"] for w in workers})
        ms = [tr.step() for _ in range(4)]
        ray.kill(workers[1].actor, no_restart=True)  # born again (initial weights + the current version)
        ms += [tr.step() for _ in range(2)]
        res["restarts"] = [w.restarts for w in workers]
        res["versions"] = [w.info()["version"] for w in workers]
        res["learner_version"] = tr.version
        res["staleness"] = [m["staleness_max"] for m in ms]
        res["delta_frac"] = [m["delta_frac"] for m in ms]
        res["publish_bytes"] = [[m["publish_bytes"], m["publish_full_bytes"]] for m in ms]
        res["partial"] = [m["partial_rows_frac"] for m in ms]
        res["token_staleness"] = [s for _, _, s in tr.trained]
        uids = [u for _, us, _ in tr.trained for u in us]
        res["trained"], res["distinct"] = len(uids), len(set(uids))
        b = tr.collector.queue.buffer
        res["conservation"] = b.admitted == b.consumed + b.evicted + b.in_flight + b.ready
        res["evicted"] = b.evicted
        # every actor serves the learner's weights: its sampled tokens' log-probs against the policy's forward
        tr.collector.stop_workers()
        sp = dataclasses.replace(tr.generator.sampling(0), max_new_tokens=8, stop_ids=(), eos_id=None, seed=11)
        prompts = [list(tr.task.encode(s)) for s in tr.task.sample(3, 99)]
        gaps, outs = [], []
        for w in workers:
            batch = w.generate(prompts, sp, 2)
            with torch.no_grad():
                lp, _ = plain_logprobs_and_entropy(tr.policy, batch, 1.0)
            m = batch["action_mask"]
            gaps.append(float((lp - batch["rollout_logprobs"])[m].abs().max()))
            outs.append(batch)
        res["gaps"] = gaps
        # what each actor's deltas applied to (its copy of the served version) = a full publication's pieces
        full = {k: v.clone() for k, v in tr.publisher.publisher.gather(tr.policy, buffers=False).items()}

        def held(a):
            return a.engine.kept_copy.version, {k: v.clone() for k, v in a.engine.kept_copy.pieces.items()}

        res["held_exact"] = []
        for w in workers:
            v, copy = ray.get(w.actor.__ray_call__.remote(held))
            res["held_exact"].append(v == tr.version and set(copy) == set(full) and
                                     all(torch.equal(copy[k], full[k]) for k in full))
        res["actors_agree"] = torch.equal(outs[0]["tokens"], outs[1]["tokens"]) and \
            torch.equal(outs[0]["rollout_logprobs"], outs[1]["rollout_logprobs"])
        res["served_versions"] = [sorted(set(o["policy_version"].tolist())) for o in outs]

        def tp_of(a):  # the actor's engine: its TP degree and what each of its workers read at the last commit
            return [a.engine.tp, list(a.engine.last_received)]

        res["engine_tp"] = ray.get([w.actor.__ray_call__.remote(tp_of) for w in workers])
    finally:
        tr.close()
        EngineSpec.build = build
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
