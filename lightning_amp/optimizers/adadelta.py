"""FusedAdadelta: torch.optim.Adadelta semantics in one kernel call per (group, device, dtype)."""
from __future__ import annotations

import torch

from lightning_amp import ops
from lightning_amp.optimizers.base import FusedOptimizer, check_nonnegative, check_unit_interval, grads_of, new_step


class FusedAdadelta(FusedOptimizer):
    """Adadelta as ``torch.optim.Adadelta``. State per param: ``step`` (0-dim fp32),
    ``square_avg`` and ``acc_delta`` (param dtype)."""

    def __init__(self, params, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay))

    def _validate_group(self, group: dict) -> None:
        check_nonnegative("lr", group["lr"])
        if not isinstance(group["rho"], (int, float)) or not (0.0 <= group["rho"] <= 1.0):
            raise ValueError(f"Invalid rho: {group['rho']!r} (must be in [0, 1])")
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])

    def _init_state(self, p, group) -> None:
        st = self.state[p]
        st["step"] = new_step(p)
        st["square_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        st["acc_delta"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _update(self, group, parts, grad_scale, found_inf) -> None:
        for (device, _, _), ps in parts.items():
            states = [self.state[p] for p in ps]
            ops.multi_tensor_adadelta(
                ps, grads_of(ps), [st["square_avg"] for st in states], [st["acc_delta"] for st in states],
                [st["step"] for st in states], lr=group["lr"], rho=group["rho"], eps=group["eps"],
                weight_decay=group["weight_decay"], grad_scale=grad_scale(device), found_inf=found_inf(device),
            )
