"""FusedAdam: torch.optim.AdamW / Adam semantics in one kernel call per (group, device, dtype)."""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_amp import ops
from lightning_amp.optimizers.apex_keywords import take_apex_keywords
from lightning_amp.optimizers.base import (
    FusedOptimizer,
    as_pair,
    check_betas,
    check_nonnegative,
    grads_of,
    new_step,
)

_HALF = (torch.float16, torch.bfloat16)


class FusedAdam(FusedOptimizer):
    """Adam with decoupled weight decay (``adam_w_mode=True`` = ``torch.optim.AdamW``) or L2
    weight decay (``adam_w_mode=False`` = ``torch.optim.Adam``), optional AMSGrad.

    ``master_weights=True``: every fp16/bf16 param gets an fp32 master copy in its state
    (``state["master_param"]``, with fp32 ``exp_avg``/``exp_avg_sq``); the kernel updates the
    master from the 16-bit grad and writes the param as the master rounded to its dtype in the
    same pass. The masters are saved in ``state_dict`` so a resume is exact. Changing a param's
    values from outside (e.g. loading model weights) does not update its master.

    apex's ``set_grad_none`` and ``capturable`` are taken as :mod:`~lightning_amp.optimizers.apex_keywords` says.

    State per param (as torch): ``step`` (0-dim fp32), ``exp_avg``, ``exp_avg_sq``
    (+ ``max_exp_avg_sq`` with AMSGrad), in the param's dtype unless master weights apply.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 master_weights: bool = False, **apex_keywords):
        self.set_grad_none = take_apex_keywords("FusedAdam", apex_keywords, ("set_grad_none", "capturable"))
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=as_pair(betas),
                        eps=eps, adam_w_mode=adam_w_mode, weight_decay=weight_decay, amsgrad=amsgrad,
                        master_weights=master_weights)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        check_nonnegative("lr", group["lr"])
        check_betas(group["betas"])
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
        for flag in ("bias_correction", "adam_w_mode", "amsgrad", "master_weights"):
            if not isinstance(group[flag], bool):
                raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be True or False)")

    @staticmethod
    def _uses_master(p: Tensor, group: dict) -> bool:
        return bool(group["master_weights"]) and p.dtype in _HALF

    def _state_dtype(self, p: Tensor, group: dict, key: str) -> torch.dtype:
        return torch.float32 if self._uses_master(p, group) else p.dtype

    def _init_state(self, p: Tensor, group: dict) -> None:
        st = self.state[p]
        master = self._uses_master(p, group)
        dtype = torch.float32 if master else p.dtype
        st["step"] = new_step(p)
        st["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        if group["amsgrad"]:
            st["max_exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        if master:
            st["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()

    def _partition_key(self, p: Tensor, group: dict) -> tuple:
        return (p.device, p.dtype, p.grad.dtype, self._uses_master(p, group))

    def _update(self, group, parts, grad_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        for (device, _, _, master), ps in parts.items():
            states = [self.state[p] for p in ps]
            if group["amsgrad"]:
                for p, st in zip(ps, states):  # amsgrad switched on after a checkpoint without it
                    if "max_exp_avg_sq" not in st:
                        st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
            ops.multi_tensor_adam(
                [st["master_param"] for st in states] if master else ps,
                grads_of(ps),
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                [st["step"] for st in states],
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"], bias_correction=group["bias_correction"],
                max_exp_avg_sqs=[st["max_exp_avg_sq"] for st in states] if group["amsgrad"] else None,
                grad_scale=grad_scale(device), found_inf=found_inf(device),
                model_copies=ps if master else None, checked=self._checked,
            )
