"""TRL's ``GRPOTrainer`` computing its policy loss through ``hyperrl.transforms``.

A ten-line subclass: TRL keeps generation, rewards and advantages; the per-token objective and the
aggregation are hyperrl's (``ppo_clip`` with TRL's ε_low/ε_high, token-mean). Swap ``objective`` /
``agg`` for any registered variant (``cispo``, ``sapo``, ``gspo``, ``seq-mean-token-mean`` …).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from trl import GRPOTrainer

import hyperrl.transforms as T


class HyperRLGRPOTrainer(GRPOTrainer):
    objective = "ppo_clip"
    agg = "token-mean"

    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        mask = inputs["completion_mask"].bool()
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                              completion_ids.size(1))
        old = inputs.get("old_per_token_logps")
        adv = inputs["advantages"]
        adv = adv[:, None].expand_as(logps) if adv.dim() == 1 else adv
        batch = TensorDict({"action_mask": mask, "advantages": adv.float(),
                            "old_logprobs": logps.detach() if old is None else old}, batch_size=[mask.shape[0]])
        out = T.policy_loss(batch, logps, objective=self.objective, agg=self.agg,
                            clip_low=self.epsilon_low, clip_high=self.epsilon_high)
        return out.loss
