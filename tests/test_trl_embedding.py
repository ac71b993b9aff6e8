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
