"""The mismatch doctor: one cause injected on the engine's side at a time — top-p sampled with processed log-probs,
an engine serving bf16 weights, an engine whose LM head runs in bf16, a stale version, MoE routers that pick other
experts — and the doctor names that cause first, closing (nearly) the whole gap; no cause when the engine and the
trainer agree; ``hyperrl doctor`` on a recorded run, the automatic diagnosis when the mismatch is high, and the
refused gate's verdict."""

import json

import pytest
import torch

from hyperrl.cli import main
from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.loop.collect import Timer
from hyperrl.loop.doctor import DoctorContext, diagnose
from hyperrl.loop.trainer import GateError
from hyperrl.run import train

_ARGS = ["--task=modsum", "--rollout.max_new_tokens=6", "--rollout.prompts_per_step=4", "--rollout.n=4",
         "--run.eval_every=0", "--run.threads=1", "--run.export=false"]


def _trainer(tmp_path, *extra):
    return build_trainer(load_config(None, [*_ARGS, f"--run.out_dir={tmp_path}", *extra]))


def _first(d):
    return d.causes[0][0], d.causes[0][3]


def test_no_cause_when_the_engine_and_the_trainer_agree(tmp_path):
    tr = _trainer(tmp_path)
    d = tr.doctor(tr.collect(Timer()).batch)
    assert d.gap < 1e-5 and d.verdict().startswith("no gap beyond float rounding")


def test_top_p_with_processed_log_probs_is_named_sampling(tmp_path):
    tr = _trainer(tmp_path, "--rollout.top_p=0.7")
    d = tr.doctor(tr.collect(Timer()).batch)
    assert d.gap > 0.05 and _first(d)[0] == "sampling" and _first(d)[1] > 0.99
    assert d.verdict().startswith("sampling: ")


def test_an_engine_serving_bf16_weights_is_named_compute_dtype(tmp_path):
    tr = _trainer(tmp_path, "--rollout.engine={name: transformers, dtype: bfloat16}")
    d = tr.doctor(tr.collect(Timer()).batch)
    assert d.gap > 1e-4 and _first(d)[0] == "compute_dtype" and _first(d)[1] > 0.9


class _Bf16Head(torch.nn.Module):
    """An LM head computed in bf16 (what an engine with a bf16 head does), over the same weights."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.nn.functional.linear(x.bfloat16(), self.inner.weight.bfloat16()).float()


def test_an_engine_with_a_bf16_head_is_named_head_precision(tmp_path):
    tr = _trainer(tmp_path)
    m = tr.engine.model
    m.lm_head = _Bf16Head(m.lm_head)  # the engine's own copy; the trainer's head stays fp32
    d = tr.doctor(tr.collect(Timer()).batch)
    assert d.gap > 1e-4 and _first(d)[0] == "head_precision" and _first(d)[1] > 0.9


def test_a_stale_version_is_named_version_when_its_weights_are_at_hand(tmp_path):
    tr = _trainer(tmp_path)
    old = {k: v.clone() for k, v in tr.policy.state_dict().items()}
    batch = tr.collect(Timer()).batch  # generated at version 0
    tr.step()  # the trainer moves on to version 1
    r = tr.cfg.rollout
    ctx = DoctorContext(temperature=r.temperature, version=tr.version, weights_for={0: old}.get)
    d = diagnose(tr.policy, batch, ctx)
    assert d.versions == ([0], 1) and _first(d)[0] == "version" and _first(d)[1] > 0.99
    assert "version" in tr.doctor(batch).skipped  # the trainer alone keeps no old weights: not tried


def test_a_stale_layer_is_named_with_its_layer(tmp_path):
    """The trainer's weights moved in decoder layer 1 only since the engine's version: per layer, the stamped
    version's weights in layer 1 alone close the whole gap, in layer 0 nothing."""
    tr = _trainer(tmp_path, "--model.layers=2")
    old = {k: v.clone() for k, v in tr.policy.state_dict().items()}
    batch = tr.collect(Timer()).batch
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tr.policy.named_parameters():
            if ".layers.1." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ctx = DoctorContext(temperature=tr.cfg.rollout.temperature, version=1, weights_for={0: old}.get)
    d = diagnose(tr.policy, batch, ctx)
    assert _first(d)[0] == "version" and d.layers[0] == "version", d.table()
    assert abs(d.layers[1][0]) < 1e-3 and d.layers[1][1] > 0.99, d.table()


def test_hyperrl_doctor_on_a_recorded_run_and_the_automatic_diagnosis(tmp_path, capsys):
    run = tmp_path / "run"
    train(load_config(None, [*_ARGS, f"--run.out_dir={run}", "--run.steps=5", "--run.ckpt_every=2",
                             "--rollout.top_p=0.7"]), progress=False)
    assert "warning: step 2: trainer vs engine log-probs — sampling: " in capsys.readouterr().err
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    doc = [e for e in events if e["event"] == "doctor"]
    assert len(doc) == 1 and doc[0]["step"] == 2 and doc[0]["causes"]["sampling"] > 0.99
    assert main(["doctor", str(run)]) == 0  # the last step it has weights for: 5 (checkpoint of version 4)
    out = capsys.readouterr().out
    assert out.startswith("step 5: sampling: ") and "engine versions [4], trainer version 4" in out
    assert main(["doctor", str(run), "--step", "1"]) == 0  # the run's initial weights, rebuilt from its config
    assert capsys.readouterr().out.startswith("step 1: sampling: ")
    assert main(["doctor", str(run), "--step", "4"]) == 2
    assert "no checkpoint of version 3" in capsys.readouterr().err
    assert main(["doctor", str(run), "--step", "30"]) == 2
    assert "its rows were not kept" in capsys.readouterr().err


def test_a_refused_gate_says_the_doctors_verdict(tmp_path):
    tr = _trainer(tmp_path, "--rollout.top_p=0.7", "--algo.gate_threshold=0.001")
    with pytest.raises(GateError, match=r"update and publish refused.*; doctor: sampling: .* closes 100% of the gap"):
        tr.step()


def test_an_engine_routing_other_experts_is_named_routes(tmp_path):
    """The engine's second-layer MoE router nudged (20 % of its spread): some tokens go to other experts than the
    trainer's routers pick; replaying the engine's recorded routes closes most of the gap (the gate weights still
    differ), and one layer at a time names layer 1."""
    from hyperrl.models.moe import moe_routers

    tr = build_trainer(load_config("configs/moe.yaml", [f"--run.out_dir={tmp_path}", "--rollout.prompts_per_step=4",
                                                        "--rollout.n=4", "--run.threads=1", "--model.layers=2",
                                                        "--run.eval_every=0"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        r = moe_routers(tr.engine.model)[1]  # the second layer's router only
        r.weight.add_(torch.randn(r.weight.shape, generator=g) * 0.2 * r.weight.std())
    d = tr.doctor(tr.collect(Timer()).batch)
    assert d.gap > 1e-3 and _first(d)[0] == "routes" and _first(d)[1] > 0.8, d.table()
    # one layer at a time: layer 0 routes as the engine did already (replaying it changes nothing); layer 1's
    # replay closes what the whole replay closes
    assert d.layers[0] == "routes" and abs(d.layers[1][0]) < 1e-3 and d.layers[1][1] > 0.8, d.table()
    assert "routes one decoder layer at a time: layer 0 closes" in d.table()


def test_an_engine_attending_its_left_padding_is_named_padding(tmp_path):
    """The repeat task's prompts differ in length ("3*2=" / "3*12="): a batched engine left-pads them. The engine
    here runs its padded batch without the attention mask (the pads attended, counted in the positions) — the rows
    with the shorter prompts are scored in another context than the trainer's; re-scoring them padded the same way
    closes the gap."""
    tr = _trainer(tmp_path, "--task=repeat", "--rollout.max_new_tokens=21", "--rollout.prompts_per_step=8")
    m = tr.engine.model
    forward = m.forward

    def unmasked(*args, **kw):  # the engine's batch without its mask: HF then attends every position
        kw.pop("attention_mask", None), kw.pop("position_ids", None)
        return forward(*args, **kw)

    m.forward = unmasked
    batch = tr.collect(Timer()).batch
    first = batch["action_mask"].int().argmax(-1)
    assert len(set(first.tolist())) > 1  # prompts of several lengths: some rows were padded
    d = tr.doctor(batch)
    assert d.gap > 1e-3 and _first(d)[0] == "padding" and _first(d)[1] > 0.99, d.table()
    clean = _trainer(tmp_path / "clean", "--task=repeat", "--rollout.max_new_tokens=21")
    assert clean.doctor(clean.collect(Timer()).batch).gap < 1e-5  # the engine's own padding is masked


def test_hyperrl_doctor_on_a_lora_run_rebuilds_its_adapters(tmp_path, capsys, monkeypatch):
    """A LoRA run's checkpoints hold the adapters only: the doctor rebuilds the trainer's view (base + adapters of
    the checkpoint) — with the engine's merged weights the gap is float rounding; with top-p it is named."""
    lora = ["--model.lora={r: 8, alpha: 16}", "--optim.lr=0.01", "--run.steps=3", "--run.ckpt_every=2"]
    plain, topp = tmp_path / "plain", tmp_path / "topp"
    train(load_config(None, [*_ARGS, *lora, f"--run.out_dir={plain}"]), progress=False)
    train(load_config(None, [*_ARGS, *lora, f"--run.out_dir={topp}", "--rollout.top_p=0.7"]), progress=False)
    capsys.readouterr()
    from hyperrl.loop.doctor import doctor_run

    d, step = doctor_run(plain)
    assert step == 3 and d.gap < 1e-5, d.table()
    assert doctor_run(plain, 1)[0].gap < 1e-5  # step 1: the initial adapters (B = 0)
    assert main(["doctor", str(topp)]) == 0
    assert capsys.readouterr().out.startswith("step 3: sampling: ")
    # the checkpoint's adapters are what closes it: without them (the base alone) the gap is far beyond rounding
    monkeypatch.setattr("hyperrl.loop.checkpoint.consolidate", lambda *a, **k: {})
    assert doctor_run(plain)[0].gap > 1e-4
