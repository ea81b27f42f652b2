"""FusedSGD: torch.optim.SGD semantics (momentum, dampening, nesterov, weight decay)."""
from __future__ import annotations

import torch

from lightning_amp import ops
from lightning_amp.optimizers.apex_keywords import take_apex_keywords
from lightning_amp.optimizers.base import FusedOptimizer, check_nonnegative, grads_of

_REQUIRED = object()


class FusedSGD(FusedOptimizer):
    """SGD as ``torch.optim.SGD``: the first step initialises ``state["momentum_buffer"]`` to the
    (weight-decayed) gradient, later steps ``buf = momentum * buf + (1 - dampening) * g``;
    ``nesterov`` uses ``g + momentum * buf``. No state at all when ``momentum == 0``. apex's
    ``set_grad_none``, ``wd_after_momentum`` and ``materialize_master_grads`` are taken as
    :mod:`~lightning_amp.optimizers.apex_keywords` says."""

    def __init__(self, params, lr=_REQUIRED, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, **apex_keywords):
        self.set_grad_none = take_apex_keywords(
            "FusedSGD", apex_keywords, ("set_grad_none", "wd_after_momentum", "materialize_master_grads"))
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        if group["lr"] is _REQUIRED:
            raise ValueError("FusedSGD: lr is required (a number >= 0), as an argument or in every param group")
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_nonnegative(name, group[name])
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"Invalid nesterov: {group['nesterov']!r} (must be True or False)")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Invalid nesterov: Nesterov momentum requires momentum > 0 and dampening = 0")

    def _needs_init(self, p, group) -> bool:
        return group["momentum"] != 0 and "momentum_buffer" not in self.state.get(p, ())

    def _init_state(self, p, group) -> None:
        if group["momentum"] != 0:
            self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            self.state[p]["_fresh"] = True  # dropped after the first successful step

    def _partition_key(self, p, group) -> tuple:
        st = self.state[p]
        return (p.device, p.dtype, p.grad.dtype, bool(st.pop("_fresh", False)))

    def _update(self, group, parts, grad_scale, found_inf) -> None:
        momentum = group["momentum"]
        for (device, _, _, first_run), ps in parts.items():
            ops.multi_tensor_sgd(
                ps, grads_of(ps), [self.state[p]["momentum_buffer"] for p in ps] if momentum != 0 else None,
                lr=group["lr"], momentum=momentum, dampening=group["dampening"],
                weight_decay=group["weight_decay"], nesterov=group["nesterov"], first_run=first_run,
                grad_scale=grad_scale(device), found_inf=found_inf(device), checked=self._checked,
            )
