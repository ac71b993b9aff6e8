"""The optimizer's state off the device (``optim.offload: cpu``): AdamW stepped in host memory.

:class:`HostAdamW` keeps, per trained parameter (its local shard under FSDP / tensor parallelism), an fp32 master
copy and AdamW's two moments in host memory — three fp32 copies of the model that no longer sit beside the
activations on the accelerator (prime-rl's optimizer offload: 73.7 → 29.0 GiB at 32 k tokens for Qwen3-30B-A3B,
PR #3234). A step copies each (clipped, data-parallel-synced) gradient to the host, applies torch's own AdamW
there (``torch.optim.adamw.adamw``, the single-tensor kernel ``torch.optim.AdamW`` runs on CPU tensors) to the master,
and copies the master back into the device parameter. With the device being the CPU (this machine) the values are
``torch.optim.AdamW``'s bit for bit (tested); the state's layout is the standard optimizer ``state_dict`` (state
keyed by the device parameters: checkpoints and resume unchanged).

Why not FSDP2's ``CPUOffloadPolicy``: it also moves the parameters and gradients off the device (every forward
pays the host-to-device copy of the weights) and applies to FSDP-wrapped modules only — one process, tensor
parallelism without FSDP and LoRA adapters would not have it. The copies are not yet overlapped with backward
(the gradient is final only after the data-parallel sync and the clip).
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as _adamw  # torch's own AdamW kernel (functional)

from hyperrl.sharding.dtensor import local

__all__ = ["HostAdamW"]


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose state (moments, fp32 master) lives in host memory (module doc); the arguments as
    ``torch.optim.AdamW``'s."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _host(self, p: torch.Tensor) -> dict:
        """The parameter's host state, made at its first step (torch's AdamW makes its state lazily too)."""
        st = self.state[p]
        if not st:
            master = local(p).detach().to("cpu", torch.float32, copy=True)
            st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                      master=master)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter with a gradient, on the host; the device parameters updated."""
        if closure is not None:
            raise ValueError("HostAdamW.step: a closure is not supported (hyperrl's learner calls step() after "
                             "backward)")
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._host(p)
                grad = local(p.grad).to("cpu", torch.float32)
                _adamw([st["master"]], [grad], [st["exp_avg"]], [st["exp_avg_sq"]], [], [st["step"]], foreach=False,
                       capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
                       amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"],
                       eps=group["eps"], maximize=False)
                local(p).copy_(st["master"])  # the device parameter (its dtype) from the master

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``Optimizer.load_state_dict``, the state kept on the host in fp32 (the base class would cast it to
        each parameter's device and dtype: a bf16 parameter's master rounded)."""
        raw = {int(i): dict(st) for i, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in raw.items():
            self.state[params[i]] = {k: local(v).detach().to("cpu", torch.float32, copy=True) if torch.is_tensor(v)
                                     else v for k, v in st.items()}
