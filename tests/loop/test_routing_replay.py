"""Routing replay for a mixture-of-experts policy (docs/moe.md): the transformers engine records the experts
every token was routed to (``routed_experts [B, T, L, k]``, prompt tokens from the prefill); every trainer
forward (plain, shared-prefix, packed) can be forced to them (R3) — the gate weights still from the current
router, so the router keeps its gradient — or to the trainer's own old-pass routes (R2); the agreement of the
router's own choice with the rollout's is a metric; bad routes are refused naming the key."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.loop.forward import (
    RouteReplay,
    packed_logprobs_and_entropy,
    plain_logprobs_and_entropy,
    shared_prefix_logprobs_and_entropy,
)
from hyperrl.loop.learner import map_micro_batches
from hyperrl.models import tiny_qwen3_moe
from hyperrl.models.moe import Routing, check_routes, moe_routers, replay_weights
from hyperrl.rollout.base import SamplingParams
from hyperrl.rollout.hf import TransformersEngine
from hyperrl.trajectory import TrajectoryError, cat_batches, make_trajectory, trim_padding

E, K, L = 8, 2, 3
PROMPTS = [[1, 5, 6, 7], [1, 9, 10], [1, 11, 12, 13, 14]]
FORWARDS = {
    "plain": lambda m, b, rp: plain_logprobs_and_entropy(m, b, 1.0, rp),
    "shared": lambda m, b, rp: shared_prefix_logprobs_and_entropy(m, b, 1.0, replay=rp),
    "packed": lambda m, b, rp: packed_logprobs_and_entropy(m, b, 1.0, 7, rp),  # several packed calls
}


def _model(seed=3):
    return tiny_qwen3_moe(40, experts=E, top_k=K, moe_intermediate=16, hidden=32, layers=L, head_dim=16, seed=seed)


@pytest.fixture(scope="module")
def rollout():
    model = _model()
    eng = TransformersEngine(copy.deepcopy(model))
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=0, eos_id=2), n=3)
    return model, batch


def _recorded(batch):
    return (batch["routed_experts"] >= 0).all(-1).all(-1)  # [B, T]


def test_the_engine_records_every_token_but_each_rows_last(rollout):
    _, b = rollout
    re, attn = b["routed_experts"], b["attention_mask"]
    assert re.dtype == torch.int16 and tuple(re.shape) == (9, b["tokens"].shape[1], L, K)
    last = torch.arange(attn.shape[1])[None] == attn.sum(-1, keepdim=True) - 1
    # a route on every real token but the row's last (no forward ran the last sampled token), −1 on padding
    assert torch.equal(_recorded(b), attn & ~last)
    assert bool((re[~attn] == -1).all()) and int(re.max()) < E
    assert bool((re[_recorded(b)].sort(-1).values.diff(dim=-1) > 0).all())  # k distinct experts per token
    # the n samples of a prompt share its prefill: identical prompt routes
    p = int((~b["action_mask"][0]).sum() - (~attn[0]).sum())
    assert torch.equal(re[0, :p], re[1, :p]) and torch.equal(re[0, :p], re[2, :p])


@pytest.mark.parametrize("path", sorted(FORWARDS))
def test_r3_routes_every_token_as_the_rollout_did_and_reproduces_its_logprobs(rollout, path):
    model, b = rollout
    routing = Routing(model)
    rp = RouteReplay(routing, b, b["routed_experts"], force=True)
    lp, _ = FORWARDS[path](model, b, rp)
    rec = _recorded(b)
    assert torch.equal(rp.captured[rec], b["routed_experts"][rec])  # agreement 1.0, every layer
    # one process, the same weights and dtype: the trainer's log-probs are the rollout's (float rounding apart)
    assert float((lp - b["rollout_logprobs"])[b["action_mask"]].abs().max()) < 1e-5


def test_replaying_the_routers_own_choice_changes_nothing(rollout):
    model, b = rollout
    free, _ = plain_logprobs_and_entropy(model, b, 1.0)
    forced, _ = plain_logprobs_and_entropy(model, b, 1.0, RouteReplay(Routing(model), b, b["routed_experts"], True))
    assert torch.equal(free, forced)


def test_r3_overrides_a_router_that_moved_and_the_router_keeps_its_gradient(rollout):
    model, b = rollout
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for g in moe_routers(moved):
            g.weight.add_(0.05 * torch.randn_like(g.weight, generator=torch.Generator().manual_seed(0)))
    rec = _recorded(b)
    free = Routing(moved)
    rp = RouteReplay(free, b, b["routed_experts"], force=False)
    plain_logprobs_and_entropy(moved, b, 1.0, rp)
    natural = free.metrics()
    assert natural["moe_route_agree"] < 1.0 and not torch.equal(rp.captured[rec], b["routed_experts"][rec])
    forced = Routing(moved)
    rp = RouteReplay(forced, b, b["routed_experts"], force=True)
    lp, _ = plain_logprobs_and_entropy(moved, b, 1.0, rp)
    assert torch.equal(rp.captured[rec], b["routed_experts"][rec])
    # the agreement is the router's own choice, measured before replay: the first layer sees the same input
    # either way (later layers see the replayed layers' outputs)
    assert forced.metrics()["moe_route_agree_l0"] == natural["moe_route_agree_l0"]
    lp[b["action_mask"]].sum().backward()
    assert all(float(g.weight.grad.abs().sum()) > 0 for g in moe_routers(moved))


def test_agreement_counts_by_hand():
    """3 tokens, 1 layer, k = 2: the router picks {0, 1}, {2, 3}, {0, 1}; the reference {1, 0} (the same
    set, another order), {2, 4} and none (−1, not counted) → agreement 1/2. Forced: the reference where
    there is one, the router's own choice where not."""
    model = tiny_qwen3_moe(40, experts=E, top_k=K, moe_intermediate=16, hidden=32, layers=1, head_dim=16)
    router = moe_routers(model)[0]
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:4, :4] = torch.eye(4) * 50  # hidden h with large h0, h1 → experts {0, 1}
    routing = Routing(model)
    x = torch.zeros(3, 32)
    x[0, :2] = 1.0
    x[1, 2:4] = 1.0
    x[2, 0:2] = 1.0
    ref = torch.tensor([[[1, 0]], [[2, 4]], [[-1, -1]]], dtype=torch.int16)
    with routing.call(ref):
        router(x)
    assert routing.metrics() == {"moe_route_agree_l0": 0.5, "moe_route_agree": 0.5,
                                 "moe_route_all_layers_agree": 0.5}
    assert routing.used.sort(-1).values.tolist() == [[[0, 1]], [[2, 3]], [[0, 1]]]
    with routing.call(ref, force=True):
        router(x)
    assert routing.used[:2].tolist() == [[[1, 0]], [[2, 4]]] and sorted(routing.used[2, 0].tolist()) == [0, 1]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans())
def test_replayed_weights_are_the_routers_own_for_its_own_choice(seed, norm):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, E, generator=g)
    probs = torch.softmax(logits, -1)
    top, ids = probs.topk(K, -1)
    want = top / top.sum(-1, keepdim=True) if norm else top
    assert torch.equal(replay_weights(logits, ids, norm), want)
    other = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(6)])
    w = replay_weights(logits, other, norm)
    assert torch.allclose(w.sum(-1), torch.ones(6)) if norm else torch.equal(w, probs.gather(-1, other))


def test_routes_travel_with_the_batch(rollout):
    _, b = rollout
    wide = cat_batches([b[:3], trim_padding(b[3:6])])
    assert wide["routed_experts"].shape[1] == b["tokens"].shape[1]
    assert bool((wide["routed_experts"][~wide["attention_mask"]] == -1).all())  # padded with "no route"
    cut = trim_padding(b[3:6])
    assert cut["routed_experts"].shape[:2] == cut["tokens"].shape
    # a micro-batched no-grad pass returns routes padded back with −1 (not expert 0)
    out = map_micro_batches(lambda rows: rows["routed_experts"], b, budget=20)
    assert torch.equal(out, b["routed_experts"])


def test_bad_routes_are_refused_naming_the_key(rollout):
    model, b = rollout
    routing = Routing(model)
    check_routes(b, routing)
    with pytest.raises(ValueError, match=r"routed_experts: missing from the batch \(algo.routing_replay=r3\)"):
        check_routes(b.exclude("routed_experts"), routing, why=" (algo.routing_replay=r3)")
    with pytest.raises(ValueError, match=r"routed_experts: shape \[9, \d+, 2, 2\], expected \[B=9, T=\d+, L=3, k=2\]"):
        check_routes(b.clone().set("routed_experts", b["routed_experts"][:, :, :2].clone()), routing)
    big = b["routed_experts"].clone()
    big[1, 2, 1, 0] = E
    with pytest.raises(ValueError, match=r"expert id 8 at token \[1, 2\] layer 1; the policy has 8 experts"):
        check_routes(b.clone().set("routed_experts", big), routing)
    hole = b["routed_experts"].clone()
    hole[4, 1] = -1
    with pytest.raises(ValueError, match=r"token \[4, 1\] has no route \(−1\) but a trained log-prob depends on it"):
        check_routes(b.clone().set("routed_experts", hole), routing)
    fields = {k: b[k] for k in ("tokens", "attention_mask", "action_mask", "rollout_logprobs", "policy_version",
                                "group_id", "reward")}
    with pytest.raises(TrajectoryError, match=r"routed_experts: shape \[9, \d+\], expected \[9, \d+, …, …\]"):
        make_trajectory(**fields, routed_experts=b["routed_experts"][..., 0, 0])
    with pytest.raises(TrajectoryError, match="routed_experts: token .* negative expert id other than −1"):
        make_trajectory(**fields, routed_experts=b["routed_experts"] - 2)
    with pytest.raises(TrajectoryError, match="routed_experts: dtype torch.float32, expected integers"):
        make_trajectory(**fields, routed_experts=b["routed_experts"].float())
    assert isinstance(make_trajectory(**fields, routed_experts=b["routed_experts"].long()), TensorDict)


@pytest.mark.parametrize("over, msg", [
    (["--model.experts=0"], r"algo.routing_replay=r3: the policy is dense \(model.experts=0\)"),
    (["--model.gradient_checkpointing=true"], "recompute would route by itself"),
])
def test_replay_config_errors_at_load(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config("configs/moe.yaml", ["--algo.routing_replay=r3", *over])


def test_replay_with_an_agent_program_is_refused_at_load(tmp_path):
    (tmp_path / "prog.py").write_text("def solve(sample, client):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="env=agent: the gateway's rows do not carry routed_experts"):
        load_config("configs/moe.yaml", ["--algo.routing_replay=r3",
                                         f"--env={{name: agent, program: '{tmp_path}/prog.py:solve'}}"])


def test_an_engine_that_does_not_record_routes_is_refused_at_load():
    from hyperrl.config.checks import _check_replay
    from hyperrl.rollout.base import Capabilities
    from hyperrl.rollout.engines import declared_capabilities

    assert declared_capabilities("transformers", {}).routes  # the TP engine's too (its routers are whole)
    assert declared_capabilities("transformers", {"tp": 2}).routes and not declared_capabilities("vllm", {}).routes
    cfg = load_config("configs/moe.yaml", ["--algo.routing_replay=r2"])
    with pytest.raises(ConfigError, match="algo.routing_replay=r2: rollout.engine=transformers does not record"):
        _check_replay(cfg, Capabilities())


@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
def test_a_moe_step_under_each_replay_mode(tmp_path, mode):
    """A bf16 engine against the fp32 trainer (production's pairing): every mode reports the agreement of the
    trainer's own routing with the rollout's; R2's update replays its old pass's routes (two epochs: an old
    pass runs)."""
    cfg = load_config("configs/moe.yaml", [f"--run.out_dir={tmp_path}", "--rollout.prompts_per_step=4",
                                           "--rollout.n=4", "--run.threads=1", f"--algo.routing_replay={mode}",
                                           "--rollout.engine={name: transformers, dtype: bfloat16}"]
                      + (["--algo.ppo_epochs=2"] if mode == "r2" else []))
    tr = build_trainer(cfg)
    try:
        assert next(tr.engine.model.parameters()).dtype == torch.bfloat16
        assert next(tr.policy.parameters()).dtype == torch.float32
        m = tr.step()
    finally:
        tr.close()
    assert {f"moe_route_agree_l{i}" for i in range(2)} | {"moe_route_agree", "moe_route_all_layers_agree"} <= set(m)
    assert 0.5 < m["moe_route_agree"] <= 1.0 and m["moe_route_all_layers_agree"] <= m["moe_route_agree"]
    assert m["mismatch_max_abs"] > 0  # bf16 against fp32


def test_a_resumed_request_keeps_its_partial_tokens_routes(rollout):
    """An aborted row resumed (after a publication): its earlier tokens keep the routes they ran with, even
    where the new weights' re-prefill routes them otherwise."""
    from hyperrl.rollout.requests import Request, requests_for, resume_requests

    model, _ = rollout
    eng = TransformersEngine(copy.deepcopy(model))
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    stop_after = iter(range(100))

    class Abort:  # abort before the fourth decode step
        def is_set(self):
            return next(stop_after) >= 3

    first = eng.generate_requests(requests_for(PROMPTS[:1], 2, uid_offset=0), sp, abort=Abort())
    again = resume_requests(first)
    assert len(again) == 2 and all(r.partial_routes is not None and len(r.partial_routes) == 3 for r in again)
    with torch.no_grad():  # a publication that moves the routers
        for g in moe_routers(eng.model):
            g.weight.add_(torch.randn_like(g.weight, generator=torch.Generator().manual_seed(1)))
    out = eng.generate_requests(again, sp)
    P = len(PROMPTS[0])
    for i, r in enumerate(again):
        pr = r.partial_routes
        recorded = (pr >= 0).all(-1).all(-1)
        assert torch.equal(out["routed_experts"][i, P:P + 3][recorded], pr[recorded])
        assert not bool(recorded.all()) and bool((out["routed_experts"][i, P + 2] >= 0).all())  # the last partial
        # token was never run before: the re-prefill routed it
    fresh = Request(9, tuple(PROMPTS[0]), partial=(5,), partial_logprobs=(-1.0,), partial_versions=(0,))
    assert fresh.partial_routes is None
    with pytest.raises(ValueError, match="partial_routes has 2 rows for 1 partial tokens"):
        Request(9, tuple(PROMPTS[0]), partial=(5,), partial_logprobs=(-1.0,), partial_versions=(0,),
                partial_routes=torch.zeros(2, L, K, dtype=torch.int16))


def test_a_multi_turn_episode_keeps_each_tokens_first_route():
    """Turn 2's prefill re-runs turn 1's tokens: they keep turn 1's routes; the observation between the turns
    (first run by turn 2's prefill) and the context's last action token (never run in turn 1) take turn 2's."""
    from hyperrl.envs.base import Episode, Limits

    class Echo:
        def reset(self, sample):
            return "12"

        def step(self, action):
            from hyperrl.envs.base import StepResult
            return StepResult(observation="3", reward=0.5, done=False)

    from hyperrl.tokenizer import char_tokenizer
    tok = char_tokenizer()
    ep = Episode(Echo(), None, tok, Limits(max_turns=3, max_obs_tokens=4, max_episode_tokens=64))
    ctx1 = len(ep.builder)
    r1 = torch.arange((ctx1 + 2) * L * K, dtype=torch.int16).view(ctx1 + 2, L, K) % E
    r1[-1] = -1  # the turn's last sampled token: no forward ran it
    ep.advance([5, 6], [-0.1, -0.2], [0, 0], r1)
    ctx2 = len(ep.builder)  # prompt + action + observation
    r2 = torch.full((ctx2 + 1, L, K), 7, dtype=torch.int16)
    ep.advance([8], [-0.3], [1], r2)
    row = ep.row()
    re = row["routes"]
    assert len(re) == len(row["tokens"]) > ctx2 + 1 and bool((re[ctx2 + 1:] == -1).all())  # turn 2's observation:
    # no forward ran it yet
    assert torch.equal(re[:ctx1 + 1], r1[:ctx1 + 1])  # turn 1's tokens keep turn 1's routes
    assert bool((re[ctx1 + 1:ctx2 + 1] == 7).all())  # its last action token and the observation: turn 2's
    batch = stack_rows([row])
    assert batch["routed_experts"].shape[:2] == batch["tokens"].shape and batch["routed_experts"].dtype == torch.int16
    ep2 = Episode(Echo(), None, tok, Limits(max_turns=2))
    ep2.advance([5], [-0.1], [0], None)  # a turn without routes: the row carries none
    assert "routes" not in ep2.row()


def stack_rows(rows):
    from hyperrl.trajectory import stack_episodes
    return stack_episodes(rows)


@pytest.mark.parametrize("eta", [None, 1])
def test_r3_over_multi_turn_episodes_sync_and_async(tmp_path, eta):
    """The calculator environment (every episode calls the tool: observations between turns) with an MoE
    policy under R3: every trained row carries routes for every token before its last action (check_routes
    passes at every batch), synchronously and asynchronously (η = 1: turns resumed across publications)."""
    from hyperrl.loop.trainer import AsyncTrainer, SyncTrainer
    from tests.loop.test_async_episodes import _Eager

    class Keep(AsyncTrainer if eta is not None else SyncTrainer):
        def collect(self, timer):
            got = super().collect(timer)
            batch = got.batch
            self.seen = getattr(self, "seen", []) + [batch]
            return got

    cfg = load_config("configs/calculator.yaml", [f"--run.out_dir={tmp_path}", "--run.eval_every=0",
                                                  "--rollout.prompts_per_step=2", "--rollout.n=4",
                                                  "--rollout.max_turns=3", "--env.max_calls=2", "--model.experts=4",
                                                  "--model.moe_intermediate=32", "--algo.routing_replay=r3",
                                                  "--run.threads=1"])
    kw = {} if eta is None else {"max_staleness": eta}
    tr = build_trainer(cfg, trainer=Keep, **kw)
    tr.generator.driver.env = lambda: _Eager(format="compact", max_calls=2)
    try:
        for _ in range(3):
            m = tr.step()
        seen = tr.seen
    finally:
        tr.close()
    # synchronously the trainer routes each fresh row exactly as the engine did; at η = 1 a row generated one
    # version back is routed by weights that moved (this tiny model at lr 1e-3: ≈ 0.4 agreement for those, 1.0 for
    # fresh ones), and how many rows are stale depends on the workers' timing (0.38-0.90 measured, lower under load)
    if eta is None:
        assert m["moe_route_agree"] == 1.0
    else:
        assert 0.0 < m["moe_route_agree"] <= 1.0
    for b in seen:
        act = b["action_mask"]
        turns = (act[:, 1:] & ~act[:, :-1]).sum(-1)
        assert bool((turns >= 2).any())  # multi-turn rows: an observation sits between two actions
        check_routes(b, Routing(tr.policy))


def test_vllm_rows_take_the_engines_routes_and_keep_a_resumed_requests():
    """vLLM's ``CompletionOutput.routed_experts [seq_len, L, k]`` (the tokens its forwards ran) as a row's
    routes: placed from the first token, −1 past them; none (an aborted request) → −1; a resumed request's
    partial tokens keep the routes they were sampled with where they have them."""
    import numpy as np

    from hyperrl.rollout.vllm_engine import row_routes

    got = np.arange(5 * L * K, dtype=np.int32).reshape(5, L, K) % E
    out = row_routes(got, 6, 3, None, (L, K))
    assert out.dtype == torch.int16 and torch.equal(out[:5], torch.as_tensor(got).to(torch.int16))
    assert bool((out[5] == -1).all())
    assert bool((row_routes(None, 4, 2, None, (L, K)) == -1).all())
    partial = torch.full((2, L, K), 7, dtype=torch.int16)
    partial[1] = -1  # the partial's last token: never run before the abort
    out = row_routes(got, 6, 3, partial, (L, K))
    assert bool((out[3] == 7).all()) and torch.equal(out[4], torch.as_tensor(got[4]).to(torch.int16))
    with pytest.raises(ValueError, match=r"routed_experts: vLLM returned \[5, 3, 4\], expected \[seq_len, L=3, k=2\]"):
        row_routes(np.zeros((5, 3, 4)), 6, 3, None, (L, K))


def test_stacked_experts_reach_vllms_w13_and_w2_row_for_row():
    """transformers ≥ 5 stacks a mixture's experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]); vLLM's
    FusedMoE holds w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]: with stacked sources the
    layout maps them whole (one process, or whole experts over expert parallelism) and refuses tensor
    parallelism, whose w13 interleaves the halves."""
    from hyperrl.sharding import LayoutError
    from hyperrl.sharding.models import from_hf_config
    from hyperrl.sharding.simulate import expected_destination
    from hyperrl.sharding.vllm import rollout_layout

    model = _model()
    shape = from_hf_config(model.config.to_dict())
    lay = rollout_layout(shape, tp=1, dp=1, dtype=torch.float32, stacked_experts=True)
    dst = expected_destination(lay, model.state_dict(), ranks=[0])[0]
    for i in range(L):
        ex = model.model.layers[i].mlp.experts
        assert torch.equal(dst[f"model.layers.{i}.mlp.experts.w13_weight"], ex.gate_up_proj.detach())
        assert torch.equal(dst[f"model.layers.{i}.mlp.experts.w2_weight"], ex.down_proj.detach())
    # the same bytes as the checkpoint's per-expert tensors through the per-expert layout
    per = rollout_layout(shape, tp=1, dp=1, dtype=torch.float32)
    I = ex.down_proj.shape[-1]
    ckpt = {}
    for i in range(L):
        ex = model.model.layers[i].mlp.experts
        for e in range(E):
            p = f"model.layers.{i}.mlp.experts.{e}."
            ckpt[p + "gate_proj.weight"] = ex.gate_up_proj.detach()[e, :I]
            ckpt[p + "up_proj.weight"] = ex.gate_up_proj.detach()[e, I:]
            ckpt[p + "down_proj.weight"] = ex.down_proj.detach()[e]
    rest = {k: v for k, v in model.state_dict().items() if ".experts." not in k}
    w13 = "model.layers.0.mlp.experts.w13_weight"
    assert torch.equal(expected_destination(per, {**rest, **ckpt}, ranks=[0])[0][w13], dst[w13])
    ep = rollout_layout(shape, tp=1, dp=2, ep=2, dtype=torch.float32, stacked_experts=True)
    assert ep.params["model.layers.0.mlp.experts.w13_weight"].local_shape(1) == (E // 2, 2 * I, 32)
    # ep = tp (the transformers TP engine): experts split over each TP group, replicated over the dp groups —
    # ranks 0 and 2 (tp coordinate 0) hold experts 0 … E/2 − 1, ranks 1 and 3 the rest
    grp = rollout_layout(shape, tp=2, dp=2, ep=2, dtype=torch.float32, stacked_experts=True)
    want = expected_destination(grp, model.state_dict(), ranks=[0, 1, 2, 3])
    for r in range(4):
        lo = (r % 2) * (E // 2)
        assert torch.equal(want[r][w13], model.model.layers[0].mlp.experts.gate_up_proj.detach()[lo:lo + E // 2])
    with pytest.raises(ValueError, match="ep=tp splits the experts over each TP group"):
        rollout_layout(shape, tp=2, dp=2, ep=3, dtype=torch.float32, stacked_experts=True)
    with pytest.raises(LayoutError, match="whole experts"):
        rollout_layout(shape, tp=2, dp=1, dtype=torch.float32, stacked_experts=True)
