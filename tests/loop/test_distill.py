"""On-policy distillation (issue 31, item 2): the advantage kernel (golden values by hand), a teacher that is the
student's own initial weights gives zero advantages on the student's tokens (the teacher scores the same ids,
aligned), multi-teacher routing by data_source, and the bad inputs refused naming the key."""

import math

import pytest
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import ConfigError, load_config
from hyperrl.trajectory import make_trajectory
from hyperrl.transforms import add_distill_advantages, distill_advantages

FAST = ["--rollout.prompts_per_step=4", "--rollout.n=4", "--run.eval_every=0", "--run.threads=1"]


def test_distill_advantages_golden():
    # student log .5, teacher log .25: A = −2·(log .5 − log .25) = −2·log 2 = −1.386294; swapped: +1.386294;
    # masked positions 0
    s = torch.tensor([[math.log(0.5), math.log(0.25), -1.0]])
    t = torch.tensor([[math.log(0.25), math.log(0.5), -9.0]])
    m = torch.tensor([[True, True, False]])
    torch.testing.assert_close(distill_advantages(s, t, m, coef=2.0), torch.tensor([[-1.386294, 1.386294, 0.0]]))
    pad = torch.nn.functional.pad  # a prompt token first (position 0), as every trajectory has
    s, t, m = pad(s, (1, 0)), pad(t, (1, 0)), pad(m, (1, 0))
    b = make_trajectory(tokens=torch.tensor([[4, 5, 6, 7]]), attention_mask=torch.ones(1, 4, dtype=torch.bool),
                        action_mask=m, rollout_logprobs=torch.where(m, s, 0.0),
                        group_id=torch.zeros(1, dtype=torch.long),
                        policy_version=torch.zeros(1, dtype=torch.long), reward=torch.ones(1))
    b = b.set("old_logprobs", s).set("teacher_logprobs", t).set("advantages", torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    out = add_distill_advantages(b, coef=2.0, task_coef=0.5)  # 0.5·1 + d
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.0, -0.886294, 1.886294, 0.0]]))
    assert torch.equal(b["advantages"], torch.tensor([[0.0, 1.0, 1.0, 0.0]]))  # the input is not mutated
    torch.testing.assert_close(add_distill_advantages(b, coef=2.0)["advantages"], out["distill_advantages"])


def _teacher(path, *, seed=0, tok=None, sharp=1.0, **model):
    """A teacher directory: the default config's tiny Qwen3 (its seed: the student's initial weights)."""
    from hyperrl.models import tiny_qwen3
    from hyperrl.tokenizer import char_tokenizer

    tok = tok or char_tokenizer()
    cfg = dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=256) | model
    model = tiny_qwen3(len(tok), seed=seed, pad_id=tok.pad_token_id, bos_id=tok.bos_token_id,
                       eos_id=tok.eos_token_id, **cfg)
    with torch.no_grad():  # sharp: a peaked teacher (the random student is near-uniform)
        model.lm_head.weight.mul_(sharp)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_a_teacher_equal_to_the_student_gives_zero_advantages(tmp_path):
    teacher = _teacher(tmp_path / "t")
    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path / 'run'}", *FAST,
                                          f"--algo.distill.teacher={teacher}"]))
    batch = tr.collect(__import__("hyperrl.loop.collect", fromlist=["Timer"]).Timer()).batch
    prepared, _ = tr.prepare(batch)
    out = tr.pipeline.transform(prepared)
    m = out["action_mask"]
    gap = float((prepared["teacher_logprobs"] - prepared["old_logprobs"])[m].abs().max())
    assert gap < 1e-5, gap  # the same weights score the same ids at the same positions
    assert float(out["advantages"][m].abs().max()) < 1e-4 and bool(m.any())
    m2 = tr.step()
    assert m2["policy_version"] == 1


def test_the_student_moves_toward_a_different_teacher(tmp_path):
    """A peaked random teacher (another seed): over 100 distillation steps the student's reverse KL to it —
    the full-vocabulary KL(π_s ‖ π_t) at the action positions of a fixed batch — falls (measured 0.428 →
    0.318); the entropy bonus is off (it pulls the other way)."""
    from hyperrl.loop.collect import Timer

    teacher = _teacher(tmp_path / "t", seed=7, sharp=2.0)
    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path / 'run'}", *FAST, "--optim.lr=3e-3",
                                          "--algo.entropy_coef=0", f"--algo.distill.teacher={teacher}"]))
    fixed = tr.collect(Timer()).batch

    @torch.no_grad()
    def reverse_kl():
        tok, m = fixed["tokens"], fixed["action_mask"][:, 1:]
        ls = torch.log_softmax(tr.policy(input_ids=tok).logits[:, :-1].float(), -1)
        lt = torch.log_softmax(tr.preparer.teachers[None](input_ids=tok).logits[:, :-1].float(), -1)
        return float((ls.exp() * (ls - lt)).sum(-1)[m].mean())

    before = reverse_kl()
    for _ in range(100):
        tr.step()
    after = reverse_kl()
    print(f"reverse KL to the teacher {before:.3f} → {after:.3f}")
    assert after < 0.85 * before, (before, after)


def test_multi_teacher_routes_rows_by_data_source(tmp_path):
    from hyperrl.tokenizer import char_tokenizer

    teacher = _teacher(tmp_path / "t")
    base = [f"--run.out_dir={tmp_path / 'run'}", "--task=parquet", "--task.path=tests/data/gsm8k_tiny.parquet",
            "--rollout.prompts_per_step=2", "--rollout.n=2", "--run.eval_every=0", "--rollout.max_new_tokens=8",
            "--run.threads=1"]
    tr = build_trainer(load_config(None, [*base, f"--algo.distill.teachers={{gsm8k: {teacher}}}"]))
    assert tr.step()["policy_version"] == 1 and set(tr.preparer.teachers) == {"gsm8k"}
    # a configured teacher with no rows in the batch still runs (every rank makes the same calls)
    tr = build_trainer(load_config(None, [*base, f"--algo.distill.teachers={{gsm8k: {teacher}, math: {teacher}}}"]))
    assert tr.step()["policy_version"] == 1
    tr = build_trainer(load_config(None, [*base, f"--algo.distill.teachers={{math: {teacher}}}"]))
    with pytest.raises(ValueError, match=r"algo.distill.teachers: no teacher for data_source gsm8k \(configured: "
                                         r"math\)"):
        tr.step()
    assert len(char_tokenizer()) > 0


def test_bad_teachers_are_refused_naming_the_key(tmp_path):
    from hyperrl.tokenizer import char_tokenizer

    with pytest.raises(ConfigError, match=r"algo.distill.teacher: .*nowhere is not a Hugging Face model directory"):
        load_config(None, [f"--algo.distill.teacher={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"algo.distill: set exactly one of teacher"):
        load_config(None, ["--algo.distill={coef: 1.0}"])
    other = _teacher(tmp_path / "other", tok=char_tokenizer("0123456789+-*= abc"))
    cfg = load_config(None, [f"--run.out_dir={tmp_path / 'run'}", *FAST, f"--algo.distill.teacher={other}"])
    with pytest.raises(ConfigError, match=r"algo.distill.teacher=.*other: its tokenizer is not the student's \(the "
                                          r"embedded character tokenizer\): vocabularies differ"):
        build_trainer(cfg)


@pytest.mark.parametrize("damage", ["config", "truncated", "missing", "nan"])
def test_a_damaged_teacher_is_named_at_load(tmp_path, damage):
    """A teacher directory with a corrupt config.json, truncated or missing weights, or NaN weights: one line
    naming the key, the directory and the damage — at build, not as the student's refused publication later."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "teacher"
    _teacher(path)
    weights = path / "model.safetensors"
    if damage == "config":
        (path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "missing":
        weights.unlink()
    else:
        state = load_file(weights)
        state["model.norm.weight"][3] = float("nan")
        save_file(state, weights, metadata={"format": "pt"})
    cfg = load_config(None, [f"--run.out_dir={tmp_path / 'run'}", *FAST, f"--algo.distill.teacher={path}"])
    words = {"nan": r"the teacher's weights hold NaN or inf \(1 tensors: model.norm.weight\)",
             "config": r".*: the tokenizer cannot be loaded \(OSError: .*config.json' is not a valid JSON file"
             }.get(damage, r"the teacher cannot be loaded \(\w+")  # (its tokenizer is read first: a bad config)
    with pytest.raises(ConfigError, match=rf"algo.distill.teacher=.*teacher: {words}"):
        build_trainer(cfg)


def test_clip_and_whiten_golden():
    # log-ratios (student − teacher) 1, 8, −2 on the mask: clip 5 → 1, 5, −2 → A = −1, −5, 2 (coef 1);
    # whitened: mean −4/3, population std sqrt(((1/3)² + (11/3)² + (10/3)²)/3) = sqrt(222/27) = sqrt(74/9) = 2.867442
    s = torch.tensor([[0.0, -1.0, -1.0, -3.0, 0.0]])
    t = torch.tensor([[0.0, -2.0, -9.0, -1.0, 0.0]])
    m = torch.tensor([[False, True, True, True, False]])
    torch.testing.assert_close(distill_advantages(s, t, m, clip=5.0), torch.tensor([[0.0, -1.0, -5.0, 2.0, 0.0]]))
    w = distill_advantages(s, t, m, clip=5.0, whiten=True)
    sd = math.sqrt(74 / 9)
    torch.testing.assert_close(w, torch.tensor([[0.0, (-1 + 4 / 3) / sd, (-5 + 4 / 3) / sd, (2 + 4 / 3) / sd, 0.0]]))
    assert abs(float(w[m].mean())) < 1e-6


# ---------------------------------------------------------------- full-vocabulary distillation (on-policy GKD)


def test_full_vocab_reverse_kl_golden():
    from hyperrl.transforms import full_vocab_reverse_kl

    # π_s = (0.5, 0.5), π_t = (0.25, 0.75): KL = 0.5·log(0.5/0.25) + 0.5·log(0.5/0.75)
    #                                          = 0.5·0.693147 + 0.5·(−0.405465) = 0.143841
    s = torch.tensor([[0.5, 0.5]]).log()
    t = torch.tensor([[0.25, 0.75]]).log()
    torch.testing.assert_close(full_vocab_reverse_kl(s, t), torch.tensor([0.143841]))
    assert float(full_vocab_reverse_kl(s, s)) == 0.0
    with pytest.raises(ValueError, match="one vocabulary"):
        full_vocab_reverse_kl(s, torch.zeros(1, 3))


def test_full_vocab_jsd_golden_and_its_ends():
    from hyperrl.transforms import full_vocab_jsd, full_vocab_reverse_kl

    s = torch.tensor([[0.5, 0.5]]).log()  # the student
    t = torch.tensor([[0.9, 0.1]]).log()  # the teacher
    # β = 0.5: M = (0.7, 0.3); KL(t ‖ M) = 0.9·log(0.9/0.7) + 0.1·log(0.1/0.3) = 0.226183 − 0.109861 = 0.116321,
    # KL(s ‖ M) = 0.5·log(0.5/0.7) + 0.5·log(0.5/0.3) = −0.168236 + 0.255413 = 0.087177; JSD = 0.101749
    torch.testing.assert_close(full_vocab_jsd(s, t, 0.5), torch.tensor([0.101749]), atol=2e-6, rtol=0)
    # β = 0: the forward KL(t ‖ s) = 0.9·log(1.8) + 0.1·log(0.2) = 0.529008 − 0.160944 = 0.368064
    torch.testing.assert_close(full_vocab_jsd(s, t, 0.0), torch.tensor([0.368064]), atol=2e-6, rtol=0)
    assert torch.equal(full_vocab_jsd(s, t, 1.0), full_vocab_reverse_kl(s, t))  # β = 1: the reverse KL
    with pytest.raises(ValueError, match="beta=1.5 must be in"):
        full_vocab_jsd(s, t, 1.5)


def test_full_vocab_jsd_properties():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hyperrl.transforms import full_vocab_jsd

    @settings(max_examples=60, deadline=None)
    @given(st.integers(0, 2**31 - 1), st.floats(0.01, 0.99))  # the interior: the ends are TRL's special cases
    def check(seed, beta):
        g = torch.Generator().manual_seed(seed)
        s = torch.randn(3, 7, generator=g).log_softmax(-1)
        t = torch.randn(3, 7, generator=g).log_softmax(-1)
        d = full_vocab_jsd(s, t, beta)
        assert (d >= -1e-6).all() and full_vocab_jsd(s, s, beta).abs().max() < 1e-6  # a divergence
        # the roles swap with β ↔ 1 − β: the same mixture, the same two KL terms
        torch.testing.assert_close(d, full_vocab_jsd(t, s, 1.0 - beta), atol=1e-5, rtol=1e-5)
        # the gradient reaches the student only
        x = s.clone().requires_grad_()
        y = t.clone().requires_grad_()
        full_vocab_jsd(x, y, beta).sum().backward()
        assert y.grad is None or not y.grad.any()

    check()


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_full_vocab_jsd_equals_trls_gkd_loss(beta):
    """TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (unreduced, summed over the vocabulary) on the same logits."""
    from trl.experimental.gkd import GKDTrainer

    from hyperrl.transforms import full_vocab_jsd

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), 3 * torch.randn(2, 5, 11, generator=g)
    theirs = GKDTrainer.generalized_jsd_loss(s, t, beta=beta, reduction="none").sum(-1)
    torch.testing.assert_close(full_vocab_jsd(s.log_softmax(-1), t.log_softmax(-1), beta), theirs, atol=1e-6, rtol=1e-5)


def test_jsd_beta_without_the_full_vocabulary_term_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="algo.distill.jsd_beta=0.5: .*set algo.distill.full_vocab=true"):
        load_config(None, [f"--run.out_dir={tmp_path}", f"--algo.distill.teacher={tmp_path}",
                           "--algo.distill.jsd_beta=0.5"])


@pytest.mark.parametrize("fused", ["off", "on"])
def test_full_vocab_loss_is_the_reverse_kl_at_the_action_positions(tmp_path, fused):
    """loss_distill = coef · token-mean of KL(π_s(·|s_t) ‖ π_t(·|s_t)) over the action tokens (computed by hand
    from the two models' logits here); 0 for a teacher equal to the student; the advantages are the task's
    scaled by task_coef (no sampled distillation term, no teacher_logprobs). ``fused``: optim.fused_head — the
    two heads chunk by chunk (hyperrl.transforms.head_divergence), no [B, T, V] distribution."""
    from hyperrl.loop.collect import Timer

    teacher = _teacher(tmp_path / "t", seed=7, sharp=2.0)
    FAST = [*globals()["FAST"], f"--optim.fused_head={fused}"]
    tr = build_trainer(load_config(None, [f"--run.out_dir={tmp_path / 'run'}", *FAST, "--algo.distill.coef=2.0",
                                          "--algo.distill.task_coef=0.5", "--algo.distill.full_vocab=true",
                                          f"--algo.distill.teacher={teacher}"]))
    assert "teacher_logprobs" not in tr.pipeline.needs
    batch = tr.collect(Timer()).batch
    prepared, _ = tr.prepare(batch)
    out = tr.pipeline.transform(prepared)
    m = out["action_mask"]
    assert "distill_advantages" not in out.keys()
    norm = __import__("hyperrl.transforms", fromlist=["Normalizer"]).Normalizer.from_mask(m)
    got = tr.loss(out, norm)
    with torch.no_grad():
        tok = out["tokens"]
        ls = torch.log_softmax(tr.policy(input_ids=tok, attention_mask=out["attention_mask"].long()).logits[:, :-1]
                               .float(), -1)
        lt = torch.log_softmax(tr.preparer.teachers[None](input_ids=tok, attention_mask=out["attention_mask"].long())
                               .logits[:, :-1].float(), -1)
        kl = (ls.exp() * (ls - lt)).sum(-1)
        want = 2.0 * float(kl[m[:, 1:]].sum() / m.sum())
    assert float(got.terms["loss_distill"]) == pytest.approx(want, rel=1e-4)
    assert float(got.metrics["distill_kl"]) == pytest.approx(float(kl[m[:, 1:]].mean()), rel=1e-4)
    got.loss.backward()  # the gradient reaches the student
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in tr.policy.parameters())
    same = _teacher(tmp_path / "s")  # the student's own initial weights: KL 0
    tr2 = build_trainer(load_config(None, [f"--run.out_dir={tmp_path / 'run2'}", *FAST,
                                           "--algo.distill.full_vocab=true", f"--algo.distill.teacher={same}"]))
    b2 = tr2.collect(Timer()).batch
    p2 = tr2.pipeline.transform(tr2.prepare(b2)[0])
    assert abs(float(tr2.loss(p2, norm.from_mask(p2["action_mask"])).terms["loss_distill"])) < 1e-5


def test_full_vocab_refusals(tmp_path):
    teacher = _teacher(tmp_path / "t")
    with pytest.raises(ConfigError, match=r"algo.distill.full_vocab with optim.pack_tokens"):
        load_config(None, [f"--algo.distill.teacher={teacher}", "--algo.distill.full_vocab=true",
                           "--optim.pack_tokens=256"])
    with pytest.raises(ConfigError, match=r"algo.distill.full_vocab with algo.distill.teachers"):
        load_config(None, [f"--algo.distill.teachers={{a: {teacher}}}", "--algo.distill.full_vocab=true"])
