"""FusedLAMB: apex FusedLAMB semantics (global grad-norm clipping, per-tensor trust ratio)."""
from __future__ import annotations

from collections import defaultdict

import torch

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
from lightning_amp.optimizers.sharded import any_sharded, placement_classes, shard_sum_


class FusedLAMB(FusedOptimizer):
    """LAMB as apex's ``FusedLAMB``.

    Per step: the global L2 norm of all unscaled grads of all groups is computed once; a group
    whose ``max_grad_norm > 0`` is exceeded sees grads divided by ``norm / max_grad_norm``
    (``max_grad_norm=0`` disables clipping). Then Adam moments (``grad_averaging``: the first
    moment mixes in ``(1 - beta1) * g``, else ``g``), the update
    ``u = m_hat / (sqrt(v_hat) + eps)`` plus ``weight_decay * p`` (``adam_w_mode``; otherwise the
    decay is an L2 term added to the grad), and ``p -= lr * ratio * u`` with the trust ratio
    ``||p|| / ||u||`` when ``weight_decay != 0`` or ``use_nvlamb`` (1 if either norm is 0).
    DTensor params (FSDP2, DTensor tensor parallelism): both norms are those of whole tensors, the
    squared norms of the local shards summed over the ranks holding the shards: the trust ratio's by
    DTensor (the ops' Partial outputs, one call per placement class), the global grad norm's here
    (:mod:`lightning_amp.optimizers.sharded`); every rank must step.
    State per param: ``step`` (0-dim fp32), ``exp_avg``, ``exp_avg_sq`` (param dtype).
    apex's ``set_grad_none`` and ``amsgrad`` are taken as :mod:`~lightning_amp.optimizers.apex_keywords` says.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, adam_w_mode: bool = True,
                 grad_averaging: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 **apex_keywords):
        self.set_grad_none = take_apex_keywords("FusedLAMB", apex_keywords, ("set_grad_none", "amsgrad"))
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=as_pair(betas),
                        eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
        self._global_norms: dict = {}
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        check_nonnegative("lr", group["lr"])
        check_betas(group["betas"])
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_nonnegative("max_grad_norm", group["max_grad_norm"])
        for flag in ("bias_correction", "adam_w_mode", "grad_averaging", "use_nvlamb"):
            if not isinstance(group[flag], bool):
                raise ValueError(f"Invalid {flag}: {group[flag]!r} (must be True or False)")

    def _init_state(self, p, group) -> None:
        st = self.state[p]
        st["step"] = new_step(p)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _before_update(self, grad_scale, found_inf) -> None:
        """Global norm of the unscaled grads over all groups (of whole tensors: DTensor shards summed
        over their ranks), as a 0-dim fp32 tensor per device."""
        grads = [p.grad for group in self.param_groups for p in self._params_with_grad(group)]
        sharded = any_sharded(grads)
        by_key = defaultdict(list)
        for i, g in enumerate(ops.local_shards(grads)[0]):
            by_key[(g.device, g.dtype)].append((i, g))
        squares, order, devices = [], [], []
        for (device, _), pairs in by_key.items():
            norm, each = ops.multi_tensor_l2norm([g for _, g in pairs], per_tensor=sharded)
            devices.append(device)
            if sharded:
                squares.append(each.float() ** 2)
                order.extend(i for i, _ in pairs)
            else:
                squares.append(norm.to(dtype=torch.float32).reshape(1) ** 2)
        if not squares:
            self._global_norms = {}
            return
        home = devices[0]
        squares = torch.cat([s.to(home) for s in squares])
        if sharded:
            squares = shard_sum_([grads[i] for i in order], squares)
        total = squares.sum().sqrt()
        scale = grad_scale(home)
        if scale is not None:
            total = total / scale
        self._global_norms = {device: total.to(device) for device in devices}

    def _update(self, group, parts, grad_scale, found_inf) -> None:
        beta1, beta2 = group["betas"]
        for (device, _, _), part in parts.items():
            for ps in placement_classes(part):  # DTensors: DTensor reduces the trust ratio's norms per class
                self._update_class(group, ps, device, beta1, beta2, grad_scale, found_inf)

    def _update_class(self, group, ps, device, beta1, beta2, grad_scale, found_inf) -> None:
        states = [self.state[p] for p in ps]
        ops.multi_tensor_lamb(
            ps, grads_of(ps), [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
            [st["step"] for st in states], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], global_grad_norm=self._global_norms[device],
            max_grad_norm=group["max_grad_norm"], bias_correction=group["bias_correction"],
            grad_averaging=group["grad_averaging"], adam_w_mode=group["adam_w_mode"],
            use_nvlamb=group["use_nvlamb"], grad_scale=grad_scale(device), found_inf=found_inf(device),
        )
