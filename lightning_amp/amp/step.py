"""OptimizerStep: the mixed-precision step of one optimizer, framework-free and without host syncs.

Per optimizer step (the caller runs forward/backward in between and agrees on the flag across
ranks, see :func:`agree`):

1. :meth:`OptimizerStep.unscale` (or :meth:`~OptimizerStep.inspect` when the optimizer unscales in
   its own kernel) checks every grad for inf/nan in one ``torch._amp_foreach_non_finite_check_and_unscale_``
   call per device, writing a 0-dim fp32 ``found_inf`` on the device.
2. :meth:`OptimizerStep.apply` steps through one of three drivers, chosen per step:

   * ``kernel``: a plain ``torch.optim.Adam``/``AdamW``/``SGD`` (:mod:`lightning_amp.amp.kernel_step`)
     is stepped by the fused kernels, which take ``found_inf`` and under O2 write the half copies;
   * ``protocol``: an optimizer with ``_step_supports_amp_scaling`` (FusedAdam, torch ``fused=True``)
     gets ``grad_scale``/``found_inf`` as attributes, as ``torch.amp.GradScaler`` hands them;
   * ``host``: any other optimizer; the flag is read on the host and ``step()`` is called or not
     (the only driver that synchronises, as before).

   The first step of an optimizer whose state does not exist yet reads the flag once on the host
   (so a skipped first step creates no state); afterwards the kernel and protocol drivers decide
   the skip on the device.
3. The scaler updates on the device (:meth:`LossScaler.update`), and the flag goes to the host
   asynchronously through a :class:`~lightning_amp.amp.gate.StepGate`, which tells the LR
   schedulers, counts skipped steps, names the offending params and drops their grads (``on_skip``).

Host work per step is O(1) calls over cached lists plus a few list comprehensions over the params
(gathering their current ``.grad``); the lists are rebuilt only when the param groups change.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_amp.amp.flat import FlatGradBuffer
from lightning_amp.amp.gate import StepGate
from lightning_amp.amp.kernel_step import KernelStep, supports
from lightning_amp.amp.master import MasterParams, nonfinite_flags, optimizer_grads, optimizer_params
from lightning_amp.amp.scaler import LossScaler
from lightning_amp.ops import local_shards
from lightning_amp.optimizers.base import FusedOptimizer

Factor = Union[float, Tensor]


def unscales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer divides by ``grad_scale`` and honours ``found_inf`` inside its own step."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def agree(found_inf: Tensor, group: Any = None) -> Tensor:
    """Every rank of ``group`` gets the max of ``found_inf`` (an all-reduce, no host read)."""
    if dist.is_available() and dist.is_initialized():
        found_inf = found_inf.clone()
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


class OptimizerStep:
    """Scaler, masters, drivers and the loss-scale factor carried by one optimizer's current grads.

    Args:
        optimizer: the user's optimizer (its params are the fp32 masters once ``masters`` is given).
        scaler: this optimizer's :class:`LossScaler` (moved to the params' device).
        masters: the O2 masters of ``optimizer``, or None.
        combine_grad: the stepped params' grads are views into one :class:`FlatGradBuffer`.
        fused_update: step plain torch Adam/AdamW/SGD with the fused kernels (``kernel`` driver).
        on_skip: called with this object once per skipped step, when the host learns of it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler, masters: Optional[MasterParams],
                 combine_grad: bool = False, fused_update: bool = True,
                 on_skip: Optional[Callable[["OptimizerStep"], None]] = None) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.masters = masters
        params = list(optimizer_params(optimizer))
        if params:
            scaler.to(params[0].device)
        self.flat = FlatGradBuffer(params) if combine_grad else None
        self.model_params: List[Tensor] = masters.model_params if masters else params
        self._devices = {p.device for p in params}
        copy_of = {m: h for h, m in masters.pairs} if masters else {}
        self.kernel = KernelStep(optimizer, copy_of) if fused_update and supports(optimizer) else None
        self.grad_factor: Optional[Factor] = None  # the loss scale the held grads carry (None: unscaled)
        self._factor_version = -1
        self._found: Optional[Tensor] = None
        self.skipped = 0
        self._on_skip = on_skip
        self.gate = StepGate(self._skipped)
        self.gate.attach(optimizer)

    @property
    def driver(self) -> str:
        """``"kernel"``, ``"protocol"`` or ``"host"`` (see the module docstring) for the next step."""
        if self.kernel is not None and self.kernel.usable():
            return "kernel"
        return "protocol" if unscales_in_step(self.optimizer) else "host"

    def requires_grad(self) -> bool:
        return any(p.requires_grad for p in self.model_params)

    # ---- grads ------------------------------------------------------------------------

    def rebase(self, scale: Factor, shared: bool) -> None:
        """Before a backward at ``scale``: re-base grads already held at another factor onto it.
        ``shared``: the scale is the minimum over several optimizers (always re-based)."""
        if self.masters is not None and self.masters.has_model_grads():
            self.masters.accumulate_model_grads_()
        if self.flat is not None and not self.flat.views_intact():
            self.flat.rebind()  # e.g. after zero_grad(set_to_none=True): autograd must add into the views
        factor = self.grad_factor
        if factor is not None and (shared or self._factor_version != self.scaler.steps or
                                   (isinstance(factor, float) and factor != scale)):
            grads = optimizer_grads(self.optimizer)
            if grads:
                ratio = scale / factor
                torch._foreach_mul_(grads, ratio if isinstance(ratio, Tensor) else float(ratio))
        self.grad_factor = scale.clone() if isinstance(scale, Tensor) else scale
        self._factor_version = self.scaler.steps
        self._found = None

    def _grads(self) -> List[Tensor]:
        if self.masters is not None and self.masters.has_model_grads():
            self.masters.accumulate_model_grads_()
        return [g for g in (p.grad for p in optimizer_params(self.optimizer)) if g is not None]

    def _check(self, inv: Factor) -> Tensor:
        grads, = local_shards(self._grads())  # DTensor grads (FSDP2): this rank's shards
        if self.flat is not None and self.flat.views_intact() and len(grads) == len(self.flat.params):
            grads = list(self.flat.buffers.values())  # one tensor per buffer
        device = grads[0].device if grads else next(iter(self._devices), torch.device("cpu"))
        found = torch.zeros((), dtype=torch.float32, device=device)
        if not grads:
            return found
        by_device = {device: grads} if len(self._devices) <= 1 else _by_device(grads)
        for dev, tensors in by_device.items():
            flag = found if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
            inv_t = inv.to(dev) if isinstance(inv, Tensor) else torch.full((), inv, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_t)
            if flag is not found:
                torch.maximum(found, flag.to(device), out=found)
        return found

    def unscale(self) -> Tensor:
        """Divide the grads by their factor in place (idempotent until the next backward); ``found_inf``."""
        if self._found is not None and self.grad_factor is None:
            return self._found
        factor = self.grad_factor
        self._found = self._check(1.0 if factor is None or (isinstance(factor, float) and factor == 1.0)
                                  else torch.reciprocal(factor) if isinstance(factor, Tensor) else 1.0 / factor)
        self.grad_factor = None
        return self._found

    def inspect(self) -> Tensor:
        """Check the grads for inf/nan without changing their values; ``found_inf``."""
        return self._check(1.0)

    def clear_grads(self) -> None:
        if self.masters is not None:
            self.masters.clear_grads_()
        for p in self.model_params:
            p.grad = None
        for p in optimizer_params(self.optimizer):
            p.grad = None
        if self.flat is not None:
            self.flat.zero_()  # re-attaches the views, zeroed
        self.grad_factor = None

    # ---- the step ---------------------------------------------------------------------

    def _state_incomplete(self) -> bool:
        """A protocol optimizer that is not ours may create state on a skipped first step."""
        if isinstance(self.optimizer, FusedOptimizer):
            return False  # reads the flag itself before creating state
        return len(self.optimizer.state) < sum(len(g["params"]) for g in self.optimizer.param_groups)

    @torch.no_grad()
    def apply(self, found_inf: Tensor, in_kernel: bool, **step_kwargs: Any) -> None:
        """Step (or skip, on the device) with the agreed ``found_inf``, update the scale, report the flag.
        ``in_kernel``: the grads were only inspected and the optimizer unscales them (protocol driver)."""
        driver = self.driver
        if driver == "kernel" and not in_kernel:
            skipped = bool(found_inf.item()) if self.kernel.needs_host_flag else False
            on = lambda device: found_inf if found_inf.device == device else found_inf.to(device)  # noqa: E731
            self.kernel.step(on, skipped_on_host=skipped)
        elif (driver == "host" or self._state_incomplete()) and bool(found_inf.item()):
            pass  # skipped, decided on the host (see the module docstring)
        elif driver == "protocol":
            factor, device = self.grad_factor if in_kernel else None, found_inf.device
            self.optimizer.grad_scale = (None if factor is None else factor.reshape(()).to(device)
                                         if isinstance(factor, Tensor) else torch.full((), factor, device=device))
            self.optimizer.found_inf = found_inf
            try:
                self.optimizer.step(**step_kwargs)
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            if self.masters is not None:
                self.masters.copy_to_model_()
        else:
            self.optimizer.step(**step_kwargs)
            if self.masters is not None:
                self.masters.copy_to_model_()
        if not in_kernel:
            self.grad_factor = None
        self._found = None
        self.scaler.update(found_inf)
        self.gate.record(found_inf)

    def _skipped(self) -> None:
        self.skipped += 1
        if self._on_skip is not None:
            self._on_skip(self)
        self.clear_grads()

    def nonfinite_params(self) -> List[Tensor]:
        """The model params whose current grads hold inf/nan (reads the flags: only after a skip)."""
        params = [p for p in optimizer_params(self.optimizer) if p.grad is not None]
        _, flags = nonfinite_flags(local_shards([p.grad for p in params])[0])
        if flags is None:
            return []
        halves = {id(m): h for h, m in self.masters.pairs} if self.masters is not None else {}
        return [halves.get(id(p), p) for p, flag in zip(params, flags.tolist()) if flag]


def _by_device(tensors: List[Tensor]) -> Dict[torch.device, List[Tensor]]:
    out: Dict[torch.device, List[Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


@torch.no_grad()
def all_reduce_master_grads(states: List[OptimizerStep], group: Any = None) -> None:
    """Average over ``group`` the grads that earlier ``no_sync`` backwards left in the masters
    (DDP skipped them): one all-reduce over all masters' grads, flattened."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    masters = list({id(m): m for s in states if s.masters is not None for m in s.masters.masters}.values())
    if not masters:
        return
    flat = torch.cat([(m.grad if m.grad is not None else torch.zeros_like(m)).reshape(-1) for m in masters])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    offset = 0
    for m in masters:
        chunk = flat[offset : offset + m.numel()].view_as(m)
        if m.grad is None:
            m.grad = chunk.clone()
        else:
            m.grad.copy_(chunk)  # in place: keeps combine_grad's flat-buffer views attached
        offset += m.numel()
