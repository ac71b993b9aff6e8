"""The critic: a causal-LM backbone with a linear value head."""

from __future__ import annotations

import torch
from tensordict import TensorDict

__all__ = ["ValueModel"]


class ValueModel(torch.nn.Module):
    """A critic: a causal-LM backbone plus a linear value head. ``forward(batch)`` returns
    token-aligned values ``[B, T]``: ``values[:, t]`` is the value of the state before token ``t``
    (read from the hidden state at ``t − 1``, like the log-probs); ``values[:, 0] = 0``."""

    def __init__(self, backbone, hidden: int):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: TensorDict | None = None, **inputs) -> torch.Tensor:
        """Token-aligned values ``[B, T]`` of ``batch``; or, given the backbone's keyword ``inputs`` instead (a
        context-parallel slice's ids and positions), the value read at each of their positions ``[B, S]``, unshifted
        (called through the module, so FSDP2 gathers the weights either way)."""
        if batch is None:
            return self.head(self.backbone(**inputs).last_hidden_state).squeeze(-1)
        h = self.backbone(input_ids=batch["tokens"], attention_mask=batch["attention_mask"].long()).last_hidden_state
        v = self.head(h[:, :-1]).squeeze(-1)
        return torch.nn.functional.pad(v, (1, 0))
