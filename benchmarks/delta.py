"""Delta against full publication (issue 33, item 1) on a bf16 engine fed by fp32 master weights at RL learning
rates: a Qwen3-0.6B-shaped model (hidden 1024, 16 heads × 128, MLP 3072, vocab 151,936; ``--layers`` of its 28,
default 4 — the embedding and head are most of the bytes either way) trained with AdamW on a causal-LM loss over
random token batches; after every step the policy is published to two transformers engines (bf16), one by delta
(:mod:`hyperrl.rollout.delta`) and one in full, each timed end to end (gather, cast, encode / stage, verify,
commit). Prints, per learning rate, the fraction of bf16 elements that changed, the bytes and the times, checks
that both engines hold bit-identical weights, and appends the table to benchmarks/RESULTS.md.

    python benchmarks/delta.py --lrs 1e-6 3e-6 1e-5 --steps 5
    python benchmarks/delta.py --world 2 --lrs 1e-6 --steps 5   # FSDP2 over 2 gloo processes, an engine per rank
    python benchmarks/delta.py --world 2 --codecs sparse xor_zstd   # the two encodings side by side
    python benchmarks/delta.py --ray 1 --lrs 1e-6 --steps 5   # into a Ray actor: the object store is the wire

With ``--world N`` the master weights are FSDP2-sharded over N gloo processes and each rank's engines receive the
other ranks' shards through the direct plan — the delta as each slice's changed elements on the wire; times are the
slowest rank's, bytes the wire's over all ranks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import append_results, table  # noqa: E402


def run(lr: float, steps: int, layers: int, seed: int = 0, codec: str = "sparse") -> list[list]:
    from hyperrl.rollout.engines import ENGINES, EngineContext
    from hyperrl.rollout.publisher import Publisher
    from hyperrl.tokenizer import char_tokenizer

    policy = _model(layers, seed)  # fp32 master weights
    tok = char_tokenizer()
    engines = [ENGINES.build("transformers")(EngineContext(policy, torch.device("cpu"), torch.bfloat16, seed,
                                                           tempfile.mkdtemp(), tok)) for _ in range(2)]
    rows = _timed_steps(policy, [Publisher.for_engine(policy, e) for e in engines], lr, steps, codec, seed)
    a, b = (e.model.state_dict() for e in engines)
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a), "delta ≠ full publication"
    return rows


def run_ray(lr: float, steps: int, layers: int, seed: int = 0, codec: str = "sparse", actors: int = 1) -> list[list]:
    """The same steps, each publication into a group of ``actors`` Ray actors (a transformers engine each): the
    delta group's pieces travel as deltas through Ray's object store, the full group's as the whole weights —
    each timed end to end (gather, cast, encode, the group's check, the object store, every actor's apply and
    commit)."""
    import ray

    from hyperrl.rollout.engines import ENGINES, EngineContext
    from hyperrl.rollout.publisher import Publisher
    from hyperrl.rollout.workers.ray_executor import RayEngine
    from hyperrl.tokenizer import char_tokenizer

    policy = _model(layers, seed)
    tok = char_tokenizer()
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2 * actors, include_dashboard=False, log_to_driver=False)
    try:
        groups = [RayEngine(ENGINES.build("transformers")(EngineContext(policy, torch.device("cpu"), torch.bfloat16,
                                                                        seed, tempfile.mkdtemp(), tok)),
                            workers=actors, num_cpus=1, threads=2, max_restarts=0, timeout_s=600) for _ in range(2)]
        rows = _timed_steps(policy, [Publisher.for_engine(policy, e) for e in groups], lr, steps, codec, seed)
        served = [ray.get(w.actor.__ray_call__.remote(lambda a: a.engine.model.state_dict()))
                  for grp in groups for w in grp.workers]
        assert all(torch.equal(x[k].view(torch.int16), served[0][k].view(torch.int16)) for x in served[1:]
                   for k in served[0]), "delta ≠ full publication"
        for grp in groups:
            grp.close()
    finally:
        if started:
            ray.shutdown()
    return rows


def _timed_steps(policy, pubs, lr: float, steps: int, codec: str, seed: int) -> list[list]:
    """``steps`` AdamW steps of ``policy`` (a causal-LM loss on random tokens), each published by ``pubs[0]`` as a
    delta and by ``pubs[1]`` in full, each timed end to end: one table row per step (the first publications, with
    no base yet, are untimed)."""
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    pubs[0].publish(policy, 1, delta=codec)  # the first: full (no base)
    pubs[1].publish(policy, 1)
    rows, g = [], torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        ids = torch.randint(0, policy.config.vocab_size, (4, 64), generator=g)
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        pubs[0].publish(policy, step + 1, delta=codec)
        t_delta = time.perf_counter() - t0
        t0 = time.perf_counter()
        pubs[1].publish(policy, step + 1)
        t_full = time.perf_counter() - t0
        last = pubs[0].last
        assert "delta_fallback" not in last or step == 1, last
        rows.append([codec, f"{lr:g}", step, last["delta_frac"], last["publish_bytes"] / 2**20,
                     last["publish_full_bytes"] / 2**20, last["publish_full_bytes"] / last["publish_bytes"],
                     t_delta, t_full, t_full / t_delta])
    return rows


def _model(layers: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def _dist_worker(rank, world, lr, steps, layers, seed, codec):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hyperrl.distributed import make_parallel
    from hyperrl.rollout.engines import ENGINES, EngineContext
    from hyperrl.rollout.publisher import Publisher
    from hyperrl.tokenizer import char_tokenizer

    policy = _model(layers, seed)  # fp32 master weights, the same initial ones on every rank
    tok = char_tokenizer()
    engines = [ENGINES.build("transformers")(EngineContext(policy, torch.device("cpu"), torch.bfloat16, seed,
                                                           tempfile.mkdtemp(), tok)) for _ in range(2)]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    parallel = make_parallel()  # the ranks agree on a delta publication through the parallel strategy
    pubs = [Publisher.for_engine(policy, e, rank=rank, world=world, parallel=parallel) for e in engines]
    pubs[0].publish(policy, 1, delta=codec)
    pubs[1].publish(policy, 1)
    rows, g = [], torch.Generator().manual_seed(seed + rank)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for step in range(1, steps + 1):
        ids = torch.randint(0, 151_936, (4, 64), generator=g)
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_delta = timed(lambda: pubs[0].publish(policy, step + 1, delta=codec))
        t_full = timed(lambda: pubs[1].publish(policy, step + 1))
        last = pubs[0].last
        assert "delta_fallback" not in last, last
        full_wire = last["publish_full_bytes"]
        rows.append([codec, f"{lr:g}", step, last["delta_frac"], last["publish_bytes"] / 2**20, full_wire / 2**20,
                     full_wire / last["publish_bytes"], t_delta, t_full, t_full / t_delta])
    a, b = (e.model.state_dict() for e in engines)
    assert all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a), "delta ≠ full publication"
    return rows


def run_dist(lr: float, steps: int, layers: int, world: int, seed: int = 0, codec: str = "sparse") -> list[list]:
    from tests.dist_helpers import run_gloo

    return run_gloo(_dist_worker, world, lr, steps, layers, seed, codec, timeout=3600)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--codecs", nargs="+", default=["sparse"], help="delta encodings, side by side (sparse, xor_zstd)")
    ap.add_argument("--world", type=int, default=1, help="gloo processes (FSDP2 over them; 1: one process)")
    ap.add_argument("--ray", type=int, default=0, help="publish into Ray actors (this many per group; 0: no Ray)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if args.ray:
        rows = [r for lr in args.lrs for c in args.codecs for r in run_ray(lr, args.steps, args.layers, codec=c,
                                                                               actors=args.ray)]
        where = (f"one learner process publishing into {args.ray} Ray actor(s) per group (a transformers engine "
                 "each; the pieces through Ray's object store: the deltas, or the whole weights)")
    elif args.world > 1:
        rows = [r for lr in args.lrs for c in args.codecs for r in run_dist(lr, args.steps, args.layers, args.world,
                                                                                 codec=c)]
        where = (f"FSDP2 over {args.world} gloo processes, an engine per rank (the other ranks' shards on the wire by "
                 "the direct plan; MiB = the wire's over all ranks, s = the slowest rank's)")
    else:
        rows = [r for lr in args.lrs for c in args.codecs for r in run(lr, args.steps, args.layers, codec=c)]
        where = "one process"
    out = table(["codec", "lr", "step", "delta_frac", "delta MiB", "full MiB", "bytes full/delta", "delta s", "full s",
                 "time full/delta"], rows)
    print(out)
    if not args.no_record:
        append_results("delta", f"Qwen3-0.6B-shaped ({args.layers} layers), fp32 AdamW master → bf16 transformers "
                       f"engine, {where}; both engines bit-identical after every run.\n\n" + out)


if __name__ == "__main__":
    main()
