"""TRL's GRPOTrainer with hyperrl's loss, trained for a few steps on CPU (needs the bench extra)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                reason="trl is not installed on this machine (pip install -e '.[bench]')")


@pytest.mark.slow
def test_trl_grpo_trainer_with_hyperrl_loss_trains(tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT))
    from datasets import Dataset
    from trl import GRPOConfig
    from trl_grpo_hyperrl_loss import HyperRLGRPOTrainer

    from benchmarks.e2e import hf_char_tokenizer
    from hyperrl.data.tasks import ModSumTask
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.tokenizer import char_tokenizer

    tok = char_tokenizer()
    task = ModSumTask(tok, max_operand=1)
    samples = [s for step in range(40) for s in task.sample(16, step)]
    ds = Dataset.from_dict({"prompt": ["<bos>" + s.prompt for s in samples], "answer": [s.answer for s in samples]})
    rewards = []

    def reward(completions, answer, **kw):
        r = [float(c[:1] == a) for c, a in zip(completions, answer)]
        rewards.append(sum(r) / len(r))
        return r

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=128, num_generations=8,
                      max_completion_length=1, learning_rate=3e-3, beta=0.0, max_steps=40, report_to=[],
                      use_cpu=True, save_strategy="no", shuffle_dataset=False, logging_steps=100,
                      lr_scheduler_type="constant")
    trainer = HyperRLGRPOTrainer(model=tiny_qwen3(tok.vocab_size, hidden=64, intermediate=128), reward_funcs=reward,
                                 args=args, train_dataset=ds, processing_class=hf_char_tokenizer())
    trainer.train()
    assert len(rewards) >= 40
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


OBJECTIVES_IN_THE_EXAMPLE = ("ppo_clip", "cispo", "sapo", "gspo", "gmpo")  # docs/embedding.md and the example's doc


def test_each_objective_in_the_example_gets_its_own_hyperparameters():
    import functools
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "examples"))
    from trl_grpo_hyperrl_loss import HyperRLGRPOTrainer

    import hyperrl.transforms as T

    for name in OBJECTIVES_IN_THE_EXAMPLE:
        me = SimpleNamespace(objective=name, objective_args={}, epsilon_low=0.2, epsilon_high=0.28)
        obj = HyperRLGRPOTrainer._objective(me)
        bound = obj.keywords if isinstance(obj, functools.partial) else {}
        own = T.OBJECTIVES.factory(name).defaults()
        if name == "ppo_clip":  # the one objective that shares TRL's token clips
            assert bound == {"clip_low": 0.2, "clip_high": 0.28}
        else:
            assert {k: v for k, v in {**own, **bound}.items()} == own, name  # the factory's own defaults
    gspo = HyperRLGRPOTrainer._objective(SimpleNamespace(objective="gspo", objective_args={"clip_high": 5e-4},
                                                         epsilon_low=0.2, epsilon_high=0.28))
    assert gspo.keywords == {"clip_high": 5e-4}  # objective_args override; GSPO's clip_low stays 3e-4
    with pytest.raises(ValueError, match="objective 'sapo'.clip_low: .* takes no argument 'clip_low'"):
        HyperRLGRPOTrainer._objective(SimpleNamespace(objective="sapo", objective_args={"clip_low": 0.2},
                                                      epsilon_low=0.2, epsilon_high=0.28))


@pytest.mark.slow
@pytest.mark.parametrize("objective", OBJECTIVES_IN_THE_EXAMPLE)
def test_the_example_trains_with_every_objective_it_names(tmp_path, objective):
    sys.path.insert(0, str(ROOT / "examples"))
    sys.path.insert(0, str(ROOT))
    import math

    from datasets import Dataset
    from trl import GRPOConfig
    from trl_grpo_hyperrl_loss import HyperRLGRPOTrainer

    from benchmarks.e2e import hf_char_tokenizer
    from hyperrl.models.tiny import tiny_qwen3
    from hyperrl.tokenizer import char_tokenizer

    tok = char_tokenizer()
    ds = Dataset.from_dict({"prompt": ["<bos>1+2="] * 16, "answer": ["3"] * 16})
    losses = []

    class Probe(HyperRLGRPOTrainer):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            losses.append(float(loss))
            return loss

    Probe.objective = objective
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=2, learning_rate=1e-3, beta=0.0, max_steps=2, report_to=[],
                      use_cpu=True, save_strategy="no", logging_steps=100)
    Probe(model=tiny_qwen3(tok.vocab_size, hidden=32, intermediate=64),
          reward_funcs=lambda completions, answer, **kw: [float(c[:1] == a) for c, a in zip(completions, answer)],
          args=args, train_dataset=ds, processing_class=hf_char_tokenizer()).train()
    assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), losses
