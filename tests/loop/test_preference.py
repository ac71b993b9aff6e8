"""DPO end to end (issue 31, item 3): the preference losses (golden values by hand, properties), pairs in TRL's
and verl's formats, the loss equal to TRL's DPOTrainer on the same batch, a run from random weights whose held-out
pair accuracy rises, resume, LoRA, two gloo ranks, and the errors for bad data and configs."""

import importlib.util
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hyperrl.transforms as T
from hyperrl.config import ConfigError, load_config
from hyperrl.data import DataError
from hyperrl.data.preference import PairDataset
from tests.hf_fixtures import bpe_tokenizer, qwen3_checkpoint

HAS_TRL = importlib.util.find_spec("trl") is not None


def _loss(name, **kw):
    return T.PREFERENCE_LOSSES.build(name, **kw)


# ---------------------------------------------------------------- the kernels


def test_golden_values():
    # one pair: π_c = −1, π_r = −2, ref_c = ref_r = −1.5 → Δ = (−1 + 1.5) − (−2 + 1.5) = 1; β = 0.1 → z = 0.1
    # dpo ε=0:   −log σ(0.1) = log(1 + e^−0.1) = 0.6443967
    # dpo ε=0.1: 0.9·0.6443967 + 0.1·log(1 + e^0.1) = 0.9·0.6443967 + 0.1·0.7443967 = 0.6543967
    # robust ε=0.1: (0.9·0.6443967 − 0.1·0.7443967) / 0.8 = 0.6318967
    # ipo, lengths 2 and 4: Δ' = 0.5/2 + 0.5/4 = 0.375 → (0.375 − 5)² = 21.390625; unnormalised (1 − 5)² = 16
    args = [torch.tensor([x]) for x in (-1.0, -2.0, -1.5, -1.5, 2.0, 4.0)]
    assert float(_loss("dpo")(*args)) == pytest.approx(0.6443967, abs=1e-6)
    assert float(_loss("dpo", label_smoothing=0.1)(*args)) == pytest.approx(0.6543967, abs=1e-6)
    assert float(_loss("robust", label_smoothing=0.1)(*args)) == pytest.approx(0.6318967, abs=1e-6)
    assert float(_loss("ipo")(*args)) == pytest.approx(21.390625, abs=1e-5)
    assert float(_loss("ipo", length_normalize=False)(*args)) == pytest.approx(16.0, abs=1e-5)
    out = T.preference_loss(_loss("dpo"), *args, beta=0.1, num_pairs=4.0)
    assert float(out["loss_dpo"]) == pytest.approx(0.6443967 / 4, abs=1e-6)  # the step's 4 pairs normalise
    assert float(out["reward_margin"]) == pytest.approx(0.1) and float(out["reward_accuracy"]) == 1.0
    assert float(out["rewards_chosen"]) == pytest.approx(0.05) and float(out["pair_accuracy"]) == 1.0
    # the old dpo_loss kernel is the registered dpo
    old = T.dpo_loss(*args[:4], beta=0.1, label_smoothing=0.1)
    assert float(old.loss_dpo) == pytest.approx(0.6543967, abs=1e-6)


_vals = st.lists(st.floats(-30, 0, allow_nan=False), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None)
@given(_vals, st.floats(0.01, 2.0), st.floats(0.0, 0.49))
def test_conservative_dpo_is_the_label_mixture_and_robust_dpo_is_unbiased(v, beta, eps):
    c, r, rc, rr = (torch.tensor([x], dtype=torch.float64) for x in v)
    n = torch.ones(1, dtype=torch.float64)
    plain = _loss("dpo", beta=beta)
    # cDPO: the label flipped with probability ε → (1−ε)·L(Δ) + ε·L(−Δ), L(−Δ) = the pair swapped
    mixed = (1 - eps) * plain(c, r, rc, rr, n, n) + eps * plain(r, c, rr, rc, n, n)
    assert torch.allclose(_loss("dpo", beta=beta, label_smoothing=eps)(c, r, rc, rr, n, n), mixed, atol=1e-9)
    # robust DPO: its expectation under flips with probability ε is the clean loss
    rob = _loss("robust", beta=beta, label_smoothing=eps)
    expect = (1 - eps) * rob(c, r, rc, rr, n, n) + eps * rob(r, c, rr, rc, n, n)
    assert torch.allclose(expect, plain(c, r, rc, rr, n, n), atol=1e-7 * max(1.0, float(expect.abs())))


@settings(max_examples=40, deadline=None)
@given(_vals, st.floats(0.01, 2.0), st.sampled_from(["dpo", "robust", "ipo"]))
def test_the_gradient_raises_chosen_and_lowers_rejected_until_the_target(v, beta, name):
    c, r = torch.tensor([v[0]], requires_grad=True), torch.tensor([v[1]], requires_grad=True)
    rc, rr, n = torch.tensor([v[2]]), torch.tensor([v[3]]), torch.ones(1)
    loss = _loss(name, beta=beta)(c, r, rc, rr, n, n)
    loss.sum().backward()
    delta = (v[0] - v[2]) - (v[1] - v[3])
    if name == "ipo" and delta > 1 / (2 * beta):  # IPO regresses Δ to 1/(2β): past it, it pulls back
        assert c.grad.item() >= 0 >= r.grad.item()
    else:
        assert c.grad.item() <= 0 <= r.grad.item()
    assert c.grad.item() == pytest.approx(-r.grad.item(), abs=1e-6)


def test_preference_loss_checks_shapes():
    z = torch.zeros(3)
    with pytest.raises(ValueError, match=r"ref_rejected has shape \(2,\); expected \(3,\)"):
        T.preference_loss(_loss("dpo"), z, z, z, torch.zeros(2), z, z, beta=0.1)


# ---------------------------------------------------------------- data


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_trl_and_verl_formats_encode_to_one_prompt_and_two_completions(tmp_path):
    tok = bpe_tokenizer()
    user = [{"role": "user", "content": "What is 12 + 30?"}]
    good, bad = "The answer is 42.", "The answer is 7."
    formats = {
        "explicit plain (verl, TRL)": {"prompt": "What is 12 + 30?", "chosen": good, "rejected": bad},
        "explicit conversational": {"prompt": user, "chosen": [{"role": "assistant", "content": good}],
                                    "rejected": [{"role": "assistant", "content": bad}]},
        "implicit conversational": {"chosen": user + [{"role": "assistant", "content": good}],
                                    "rejected": user + [{"role": "assistant", "content": bad}]},
        "implicit plain": {"chosen": "What is 12 + 30? The answer is 42.",
                           "rejected": "What is 12 + 30? The answer is 7."},
    }
    enc = {}
    for name, row in formats.items():
        ds = PairDataset.from_files(_write(tmp_path / f"{len(enc)}.parquet", [row]), tok)
        enc[name] = ds.encode(ds[0])
    eos = tok.eos_token_id
    plain = enc["explicit plain (verl, TRL)"]
    assert tok.decode(plain.prompt) == "What is 12 + 30?" and plain.chosen[-1] == eos == plain.rejected[-1]
    assert tok.decode(plain.chosen[:-1]) == good and tok.decode(plain.rejected[:-1]) == bad
    chat = enc["explicit conversational"]
    assert enc["implicit conversational"] == chat
    assert tok.decode(chat.prompt).endswith("<|im_start|>assistant\n")  # the generation prompt
    assert tok.decode(chat.chosen) == good + "<|im_end|>\n"  # the template's own end of turn
    implicit = enc["implicit plain"]  # TRL's extract_prompt: the common prefix cut back before the space
    assert tok.decode(implicit.prompt) == "What is 12 + 30? The answer is"
    assert tok.decode(implicit.chosen[:-1]) == " 42." and tok.decode(implicit.rejected[:-1]) == " 7."


@pytest.mark.parametrize("row, msg", [
    ({"prompt": "1+1=", "chosen": "2"}, r":0: column 'rejected' missing .* needs 'chosen' and 'rejected'"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, r":0: 'chosen' equals 'rejected'"),
    ({"prompt": "1+1=", "chosen": "", "rejected": "3"}, r":0: column 'chosen' must be a non-empty string"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
      "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
     r":0: the prompt differs between 'chosen' and 'rejected' .* part at message 0"),
    ({"chosen": "abc", "rejected": "xyz"}, r":0: the prompt differs between 'chosen' and 'rejected' — they share "
                                           r"no beginning"),
    ({"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}],
      "rejected": [{"role": "assistant", "content": "3"}]}, r"a string 'prompt' needs string completions"),
])
def test_bad_pairs_name_the_row(tmp_path, row, msg):
    with pytest.raises(DataError, match=msg):
        PairDataset.from_files(_write(tmp_path / "bad.parquet", [row]), bpe_tokenizer())


# ---------------------------------------------------------------- configs


def _pairs_files(tmp_path, n_train=None, seed=0):
    """Arithmetic preference pairs: the correct sum preferred over a wrong one — training pairs from the arith
    task's training problems, validation pairs from its held-out ones."""
    from benchmarks.dpo import arith_pair_rows

    train, val = arith_pair_rows(seed)
    return (_write(tmp_path / "train.parquet", train[:n_train] if n_train else train),
            _write(tmp_path / "val.parquet", val))


TINY = ["--model.hidden=32", "--model.layers=1", "--model.heads=2", "--model.kv_heads=1", "--model.head_dim=16",
        "--model.intermediate=64", "--run.threads=1", "--run.eval_prompts=64"]


def _cfg(tmp_path, *extra, n_train=None, out="run"):
    train, val = _pairs_files(tmp_path, n_train)
    return load_config(None, ["--algo.recipe=dpo", f"--data.train_files=[{train}]", f"--data.val_files=[{val}]",
                              f"--run.out_dir={tmp_path / out}", *extra])


def test_dpo_recipe_builds_the_preference_task_and_its_defaults(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.task.name == "preference" and cfg.algo.preference.name == "dpo"
    assert cfg.algo.preference.args == {"beta": 0.1, "label_smoothing": 0.0}  # the factory's defaults
    assert cfg.rollout.prompts_per_step == 8 and cfg.run.steps == 500  # the task's settings (pairs per step)
    ipo = load_config(None, ["--algo.recipe=ipo", f"--data.train_files=[{tmp_path / 'train.parquet'}]"])
    assert ipo.algo.preference.args == {"beta": 0.1, "length_normalize": True}


@pytest.mark.parametrize("extra, msg", [
    (["--async.max_staleness=1"], r"algo.preference=dpo with async.max_staleness: asynchronous rollout"),
    (["--algo.kl.coef=0.1"], r"with algo.kl.coef: a KL term"),
    (["--optim.mini_batches=2"], r"with optim.mini_batches: several optimizer steps"),
    (["--rollout.temperature=0.7"], r"with rollout.temperature"),
    (["--algo.preference={name: dpo, label_smoothing: 0.5}"], r"algo.preference.label_smoothing"),
    (["--algo.preference={name: dpo, beta: 0}"], r"algo.preference.beta"),
])
def test_bad_preference_configs_are_refused_at_load(tmp_path, extra, msg):
    with pytest.raises(ConfigError, match=msg):
        _cfg(tmp_path, *extra)


def test_preference_without_pairs_and_pairs_without_preference_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"algo.preference=dpo trains on preference pairs, not on task 'arith': set "
                                          r"data.train_files"):
        load_config(None, ["--algo.recipe=dpo"])
    train, _ = _pairs_files(tmp_path)
    with pytest.raises(ConfigError, match=r"task=preference holds preference pairs.*algo.recipe=dpo"):
        load_config(None, [f"--task={{name: preference, train_files: [{train}]}}"])


def test_data_without_chosen_fails_before_anything_is_written(tmp_path):
    from hyperrl.run import train

    path = _write(tmp_path / "nochosen.parquet", [{"prompt": "1+1=", "answer": "2"}])
    cfg = load_config(None, ["--algo.recipe=dpo", f"--data.train_files=[{path}]", f"--run.out_dir={tmp_path / 'o'}"])
    with pytest.raises(DataError, match=r"nochosen.parquet:0: column 'chosen' missing"):
        train(cfg, progress=False)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- the loss against TRL's DPOTrainer


def _nudge(model):
    """Add the same seeded noise (σ 0.05) to every parameter of ``model``, in its parameters' order."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _trl_and_ours(tmp_path, rows, loss_type, preference):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from hyperrl.compose import build

    ckpt = qwen3_checkpoint(tmp_path / "ckpt", seed=3)
    path = _write(tmp_path / "pairs.parquet", rows)
    cfg = load_config(None, [f"--model.checkpoint={ckpt}", f"--algo.preference={preference}",
                             f"--data.train_files=[{path}]", f"--run.out_dir={tmp_path / 'ours'}", "--run.threads=1",
                             "--optim.micro_batch_tokens=0"])
    tr = build(cfg)
    _nudge(tr.policy)  # the policy moved away from the reference (a loss of log 2 would compare nothing)
    pairs = [tr.task.dataset[i] for i in range(len(rows))]
    batch = tr.prepare(tr.collector.batch(pairs))[0]
    ours = tr.loss(batch, T.Normalizer.from_mask(batch["action_mask"]))
    beta = cfg.algo.preference.args["beta"]
    # fp32 on both sides: TRL's default bf16=True autocasts the reference model it prepares (not yet the policy)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss_type], use_cpu=True, report_to=[],
                     label_smoothing=cfg.algo.preference.args.get("label_smoothing", 0.0), max_length=None,
                     precompute_ref_log_probs=False, bf16=False)
    model, ref = (AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32) for _ in range(2))
    _nudge(model)
    trl = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                     processing_class=bpe_tokenizer())
    inputs = trl.data_collator([trl.train_dataset[i] for i in range(len(rows))])
    # the same token ids: TRL's rows are [chosen…, rejected…], ours chosen/rejected interleaved
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    P = len(rows)
    for i in range(P):
        for k, row in ((i, 2 * i), (P + i, 2 * i + 1)):
            assert ids[k][mask[k]].tolist() == batch["tokens"][row][batch["attention_mask"][row]].tolist()
    model.train()
    with torch.no_grad():
        theirs = trl.compute_loss(model, inputs)
    return float(ours.terms["loss_dpo"].detach()), float(theirs), ours


_PLAIN = [{"prompt": "What is 12 + 30?", "chosen": "The answer is 42.", "rejected": "It is 7."},
          {"prompt": "Tom has 3 apples and buys 4 more.", "chosen": "He has 7 apples.", "rejected": "56"},
          {"prompt": "Compute 7 * 8", "chosen": " with the calculator: 56.", "rejected": "#### 7"}]
_CHAT = [{"prompt": [{"role": "user", "content": r["prompt"]}],
          "chosen": [{"role": "assistant", "content": r["chosen"]}],
          "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in _PLAIN]


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed on this machine (pip install -e '.[bench]')")
@pytest.mark.parametrize("rows, loss_type, preference", [
    (_PLAIN, "sigmoid", "dpo"), (_CHAT, "sigmoid", "{name: dpo, beta: 0.5}"), (_CHAT, "ipo", "ipo"),
    (_PLAIN, "robust", "{name: robust, label_smoothing: 0.2}")], ids=["sigmoid-plain", "sigmoid-chat", "ipo-chat",
                                                                      "robust-plain"])
def test_the_dpo_loss_equals_trls_dpo_trainer_on_the_same_batch(tmp_path, rows, loss_type, preference):
    ours, theirs, out = _trl_and_ours(tmp_path, rows, loss_type, preference)
    print(f"{loss_type}: hyperrl {ours:.9f} TRL {theirs:.9f} gap {abs(ours - theirs):.2e}")
    assert abs(ours - theirs) < 1e-6 * max(1.0, abs(theirs))  # relative past 1: IPO's ≈ 24, where one fp32 ulp is 2e-6
    assert abs(ours - math.log(2)) > 1e-3 and math.isfinite(float(out.metrics["reward_margin"]))


# ---------------------------------------------------------------- runs


def test_dpo_from_random_weights_raises_held_out_pair_accuracy(tmp_path):
    """A tiny random model trained on arithmetic pairs (the right sum preferred): the held-out pairs — problems
    never trained on — are preferred right more and more often (the policy's own log-probs: chance at step 0)."""
    from hyperrl.run import train

    cfg = _cfg(tmp_path, "--run.threads=1", "--run.eval_prompts=128", "--run.steps=60", "--run.eval_every=30",
               "--rollout.prompts_per_step=32")  # the default tiny model, lr 1e-3
    summary = train(cfg, progress=False)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["event"] == "eval"]
    first, last = evals[0], evals[-1]
    print(f"held-out pair accuracy {first['eval_pair_accuracy']:.3f} → {last['eval_pair_accuracy']:.3f}, "
          f"reward accuracy {last['eval_reward_accuracy']:.3f}, "
          f"loss {first['eval_loss']:.4f} → {last['eval_loss']:.4f}")
    assert first["step"] == 0 and abs(first["eval_loss"] - math.log(2)) < 1e-5  # policy = reference: log 2
    assert last["eval_pair_accuracy"] >= first["eval_pair_accuracy"] + 0.2
    assert last["eval_reward_accuracy"] >= 0.7 and last["eval_loss"] < first["eval_loss"] - 0.05
    assert summary["final_eval_reward"] == last["eval_reward_accuracy"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(summary["export"]) is not None  # the HF export loads back


def test_resume_is_bit_identical(tmp_path):
    from hyperrl.compose import build

    over = [*TINY, "--run.eval_every=0", "--rollout.prompts_per_step=8"]
    a = build(_cfg(tmp_path, *over, out="a"))
    for _ in range(4):
        a.step()
    b = build(_cfg(tmp_path, *over, out="b"))
    for _ in range(2):
        b.step()
    b.save()
    c = build(_cfg(tmp_path, *over, out="b"))
    assert c.resume() and c.step_idx == 2
    for _ in range(2):
        c.step()
    for (k, p), q in zip(a.policy.state_dict().items(), c.policy.state_dict().values()):
        assert torch.equal(p, q), k
    assert a.task.loader.state == c.task.loader.state


def test_lora_dpo_trains_adapters_against_the_base(tmp_path):
    from hyperrl.compose import build

    tr = build(_cfg(tmp_path, *TINY, "--run.eval_every=0", "--rollout.prompts_per_step=16", "--model.lora={r: 4}",
                    "--optim.lr=1e-2"))
    base = {k: v.clone() for k, v in tr.policy.named_parameters() if not v.requires_grad}
    pairs = [tr.task.dataset[i] for i in range(4)]
    ref0 = tr.prepare(tr.collector.batch(pairs))[0]["ref_logprobs"]
    losses = [tr.step()["loss_dpo"] for _ in range(8)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)  # B = 0 at init: the policy is the reference
    assert min(losses[4:]) < losses[0]
    assert all(torch.equal(v, dict(tr.policy.named_parameters())[k]) for k, v in base.items())  # base frozen
    batch = tr.prepare(tr.collector.batch(pairs))[0]
    assert torch.equal(batch["ref_logprobs"], ref0)  # the reference is the base (adapters disabled), unchanged
    lp = tr.forwards.logprobs(tr.policy, batch)[0].detach()
    assert not torch.allclose(lp * batch["action_mask"], ref0 * batch["action_mask"])  # the adapters moved


def _dist_worker(rank, world, tmp, extra):
    from hyperrl.compose import build
    from tests.dist_helpers import record_grads

    cfg = load_config(None, ["--algo.recipe=dpo", f"--data.train_files=[{tmp}/train.parquet]",
                             f"--data.val_files=[{tmp}/val.parquet]", f"--run.out_dir={tmp}/dist", *TINY,
                             "--run.eval_every=0", "--rollout.prompts_per_step=8", *extra])
    tr = build(cfg)
    seen = record_grads(tr)
    m = tr.step()
    ev = tr.evaluate()
    return {"grads": {k: v.numpy() for k, v in seen.items()}, "loss": m["loss_dpo"], "acc": m["reward_accuracy"],
            "eval": {k: v for k, v in ev.items() if k.startswith("eval_")}}


@pytest.mark.dist
@pytest.mark.parametrize("extra", [[], ["--optim.micro_batch_tokens=24"], ["--model.lora={r: 4}"]],
                         ids=["fsdp", "fsdp-micro", "lora"])
def test_two_ranks_train_the_one_process_gradient(tmp_path, extra):
    """2 gloo ranks (FSDP2; LoRA: replicated base, adapters all-reduced), each 4 of the step's 8 pairs: the
    synced gradient and the loss equal one process over all 8 pairs (the loss normalised by the step's pairs); the
    evaluation, each rank half the held-out pairs, equals one process's over all of them."""
    from hyperrl.compose import build
    from tests.dist_helpers import record_grads, run_gloo

    _pairs_files(tmp_path)
    res = run_gloo(_dist_worker, 2, str(tmp_path), extra, timeout=300)
    cfg = load_config(None, ["--algo.recipe=dpo", f"--data.train_files=[{tmp_path}/train.parquet]",
                             f"--data.val_files=[{tmp_path}/val.parquet]", f"--run.out_dir={tmp_path}/one", *TINY,
                             "--run.eval_every=0", "--rollout.prompts_per_step=8", *extra])
    tr = build(cfg)
    one = record_grads(tr)
    m = tr.step()
    assert abs(res[0]["loss"] - m["loss_dpo"]) < 1e-6 and res[0]["loss"] == res[1]["loss"]
    assert set(res[0]["grads"]) == set(one) and one
    gap = max(float((torch.from_numpy(res[0]["grads"][k]) - v).abs().max()) / max(float(v.abs().max()), 1e-12)
              for k, v in one.items())
    print(f"{extra}: max relative gradient gap {gap:.2e}")
    assert gap < 1e-5
    assert all((res[1]["grads"][k] == res[0]["grads"][k]).all() for k in one)
    # evaluation: each rank scores half the 64 held-out pairs; the combined means are one process's over all of them
    ev = {k: v for k, v in tr.evaluate().items() if k.startswith("eval_")}
    assert res[0]["eval"] == res[1]["eval"] and set(ev) == set(res[0]["eval"]) and ev["eval_pairs"] == 64
    assert all(abs(res[0]["eval"][k] - v) <= 1e-5 * max(1.0, abs(v)) for k, v in ev.items()), (ev, res[0]["eval"])
