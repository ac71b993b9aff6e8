"""TRL's ``GRPOTrainer`` computing its policy loss through ``hyperrl.transforms``.

A short subclass: TRL keeps generation, rewards and advantages; the per-token objective and the
aggregation are hyperrl's (``ppo_clip`` with TRL's ε_low/ε_high, token-mean). Set ``objective`` /
``agg`` to any registered variant (``cispo``, ``sapo``, ``gspo``, ``gmpo``, ``seq-mean-token-mean`` …):
that objective takes its **own** hyperparameters — its factory's defaults (GSPO's 3e-4 / 4e-4
sequence clips, SAPO's temperatures), overridden by ``objective_args`` — never TRL's token clips,
which only ``ppo_clip`` shares.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from trl import GRPOTrainer

import hyperrl.transforms as T


class HyperRLGRPOTrainer(GRPOTrainer):
    objective = "ppo_clip"
    objective_args: dict = {}  # the objective's own hyperparameters (T.OBJECTIVES.factory(name).params)
    agg = "token-mean"

    def _objective(self):
        """The objective with its hyperparameters bound (checked against its factory): ``ppo_clip``
        takes TRL's ε_low / ε_high unless ``objective_args`` says otherwise."""
        args = dict(self.objective_args)
        if self.objective == "ppo_clip":
            args = {"clip_low": self.epsilon_low, "clip_high": self.epsilon_high, **args}
        return T.OBJECTIVES.build(self.objective, **args)

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
        out = T.policy_loss(batch, logps, objective=self._objective(), agg=self.agg)
        return out.loss
