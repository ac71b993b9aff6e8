import pytest
import torch

from hyperrl.transforms import (
    bind,
    chain,
    clip_rewards,
    compute_advantages,
    dpo_loss,
    dynamic_sampling_filter,
    kl_in_reward,
    mask_truncated,
    masked_is,
    mismatch_log_ratio,
    mismatch_metrics,
    overlong_penalty,
    rejection_mask,
    running_stats_init,
    running_stats_normalize,
    running_stats_update,
    truncated_is,
)
from tests.conftest import random_batch


def test_overlong_penalty_golden():
    # L_max 10, buffer 4: |y| <= 6 -> 0; 8 -> (6 - 8)/4 = -0.5; 10 -> -1; 11 -> -1
    out = overlong_penalty(torch.tensor([3, 6, 8, 10, 11]), max_len=10, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer=8)


def test_shaping_helpers():
    torch.testing.assert_close(clip_rewards(torch.tensor([-20.0, 3, 20])), torch.tensor([-10.0, 3, 10]))
    m = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    out = kl_in_reward(torch.tensor([[0.0, 0, 1]]), torch.tensor([[5.0, 1, 2]]), m, beta=0.1)
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.1, 0.8]]))
    assert mask_truncated(m, torch.tensor([True])).sum() == 0


def test_dynamic_sampling_filter_drops_constant_groups():
    b = random_batch(B=8, group_size=2)
    b["reward"] = torch.tensor([1.0, 1, 0, 1, 0, 0, 0.5, 0.2])
    kept, dropped = dynamic_sampling_filter(b)
    assert dropped == 4 and kept["group_id"].tolist() == [1, 1, 3, 3]
    assert b.batch_size[0] == 8


def test_is_corrections():
    m = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    a = torch.tensor([[0.0, -1.0, -1.0]])
    r = torch.tensor([[5.0, -1.0 - torch.log(torch.tensor(4.0)).item(), -1.0]])
    lr = mismatch_log_ratio(a, r, m)
    # token weights: [0, 4, 1]; TIS cap 2 -> [0, 2, 1]; sequence weight = 4*1 = 4 on every token
    torch.testing.assert_close(truncated_is(lr, m, cap=2.0).weights, torch.tensor([[0.0, 2.0, 1.0]]))
    torch.testing.assert_close(truncated_is(lr, m, cap=10.0, level="sequence").weights, torch.tensor([[0.0, 4.0, 4.0]]))
    mis = masked_is(lr, m, lo=0.5, hi=2.0)
    assert mis.mask.tolist() == [[False, False, True]]
    keep = rejection_mask(a, r, m, estimator="k1", threshold=0.5, level="token")
    assert keep.tolist() == [[False, False, True]]
    keep = rejection_mask(a, r, m, estimator="k1", threshold=0.5, level="sequence")
    assert keep.tolist() == [[False, False, False]]
    mm = mismatch_metrics(a, r, m)
    assert float(mm["mismatch_max_abs"]) == pytest.approx(float(torch.log(torch.tensor(4.0))))


def test_dpo_golden():
    # margin z = 0.1*((−1 − −2) − (−3 − −2)) = 0.1*2 = 0.2 -> loss = −log σ(0.2) = 0.59814
    out = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    assert float(out.loss_dpo) == pytest.approx(0.598139, abs=1e-5)
    assert float(out.accuracy) == 1.0


def test_running_stats_match_full_batch():
    xs = [torch.randn(n) * 3 + 1 for n in (5, 1, 17, 0, 9)]
    s = running_stats_init()
    for x in xs:
        before = s
        s = running_stats_update(s, x)
        assert before == running_stats_update(before, torch.zeros(0))  # old state untouched
    full = torch.cat(xs).double()
    assert s.count == full.numel()
    assert s.mean == pytest.approx(float(full.mean()))
    assert s.var == pytest.approx(float(full.var(unbiased=True)))
    z = running_stats_normalize(s, full)
    assert float(z.std()) == pytest.approx(1.0, abs=1e-6)


def test_chain_composes_pure_stages():
    b = random_batch(B=8, seed=9)
    shape = lambda batch: batch.set("reward", clip_rewards(batch["reward"] * 30, lo=-1, hi=1))
    pipeline = chain(lambda x: x.copy(), shape, bind(compute_advantages, estimator="rloo"))
    out = pipeline(b)
    assert "advantages" in out.keys() and "advantages" not in b.keys()
    assert out["reward"].abs().max() <= 1
    assert len(pipeline.stages) == 3
    with pytest.raises(TypeError, match="stage 0"):
        chain(lambda x: 3)(b)
    with pytest.raises(TypeError, match="not callable"):
        chain(3)
