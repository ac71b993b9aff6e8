"""What an algorithm adds around the update, each piece one registered function: **key providers**
(:mod:`.keys` — the batch keys its components need before the advantages: critic values, a greedy baseline,
behaviour / reference / teacher log-probs, M2PO's mask) and **loss terms** (:mod:`.terms` — the pieces whose sum
is the trainer's loss: the policy objective, the critic's value loss, full-vocabulary distillation, the router's
load balancing, a preference loss). An algorithm that needs a new key or a new term registers one function and
names it in a recipe (docs/trainer.md, "where do I add"); the loop is not edited.
"""

from hyperrl.algorithms.keys import (
    KEY_PROVIDERS,
    GateError,
    PrepareContext,
    Provided,
    Provider,
    eval_mode,
    provider_order,
    providers,
)
from hyperrl.algorithms.terms import LOSS_TERMS, LossContext, PolicyOut, Term, pair_logps, sum_terms, term

__all__ = ["KEY_PROVIDERS", "LOSS_TERMS", "Provided", "PrepareContext", "LossContext", "PolicyOut", "GateError",
           "provider_order", "eval_mode", "pair_logps", "sum_terms", "Term", "term", "Provider", "providers"]
