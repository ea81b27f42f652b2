"""OptimizerStep: the mixed-precision step of one optimizer, framework-free and without host syncs.

Per optimizer step (the caller runs forward/backward in between and agrees on the flag across
ranks, see :func:`agree`):

1. :meth:`OptimizerStep.unscale` (or :meth:`~OptimizerStep.inspect` when the optimizer unscales in
   its own kernel) checks every grad for inf/nan in one ``torch._amp_foreach_non_finite_check_and_unscale_``
   call per device (with nothing to unscale, one read-only ``ops.multi_tensor_check_finite`` call),
   writing a 0-dim fp32 ``found_inf`` on the device (sparse and complex grads through their real
   values, :mod:`lightning_amp.amp.grad_kinds`).
2. :meth:`OptimizerStep.apply` steps through one of three drivers, chosen per step:

   * ``kernel``: a plain ``torch.optim.Adam``/``AdamW``/``SGD`` (:mod:`lightning_amp.amp.kernel_step`)
     is stepped by the fused kernels, which take ``found_inf``;
   * ``protocol``: an optimizer with ``_step_supports_amp_scaling`` (FusedAdam, torch ``fused=True``)
     gets ``grad_scale``/``found_inf`` as attributes, as ``torch.amp.GradScaler`` hands them;
   * ``host``: any other optimizer; the flag is read on the host and ``step()`` is called or not
     (the only driver that synchronises, as before).

   Where ``step()`` is called, it is called as Lightning's own precision would call it: with a scaler that
   scales the loss (float16) as ``torch.amp.GradScaler.step`` does, without the ``closure`` the caller handed
   on (Lightning's ``16-mixed``), else with it (``bf16-mixed``, ``32-true``).

   The first step of an optimizer whose state does not exist yet reads the flag once on the host
   (so a skipped first step creates no state); afterwards the kernel and protocol drivers decide
   the skip on the device.
3. The scaler updates on the device (:meth:`LossScaler.update`), and the flag goes to the host
   asynchronously through a :class:`~lightning_amp.amp.gate.StepGate`, which tells the LR
   schedulers, counts skipped steps, names the offending params and drops their grads (``on_skip``),
   all from that step's own record (:class:`SkipReport`: per-param flags, scale and overflow count
   copied with the flag), however many steps later it lands (:class:`_LateSkip`).

Host work per step is O(1) calls over cached lists plus a few list comprehensions over the params
(gathering their current ``.grad``); the lists are rebuilt only when the param groups change.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_amp.amp.flat import FlatGradBuffer
from lightning_amp.amp.gate import StepGate
from lightning_amp.amp.grad_kinds import check_and_unscale_, check_finite, real_values
from lightning_amp.amp.kernel_step import KernelStep, supports
from lightning_amp.amp.param_views import optimizer_grads, optimizer_params
from lightning_amp.amp.scaler import LossScaler
from lightning_amp.amp.scaling_protocol import creates_state_only_on_clean_steps, unscales_in_step
from lightning_amp.ops import local_shards

Factor = Union[float, Tensor]


def agree(found_inf: Tensor, group: Any = None) -> Tensor:
    """Every rank of ``group`` gets the max of ``found_inf`` (an all-reduce, no host read)."""
    if dist.is_available() and dist.is_initialized():
        found_inf = found_inf.clone()
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


class OptimizerStep:
    """Scaler, drivers and the loss-scale factor carried by one optimizer's current grads.

    Args:
        optimizer: the user's optimizer (its params are the module's own params at every level).
        scaler: this optimizer's :class:`LossScaler` (moved to the params' device).
        combine_grad: the stepped params' grads are views into one :class:`FlatGradBuffer`.
        fused_update: step plain torch Adam/AdamW/SGD with the fused kernels (``kernel`` driver).
        on_skip: called with this object and the step's :class:`SkipReport` once per skipped step,
            when the host learns of it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler, combine_grad: bool = False,
                 fused_update: bool = True,
                 on_skip: Optional[Callable[["OptimizerStep", "SkipReport"], None]] = None) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        params = list(optimizer_params(optimizer))
        if params:
            scaler.to(params[0].device)
        self.flat = FlatGradBuffer(params) if combine_grad else None
        self._devices = {p.device for p in params}
        self.kernel = KernelStep(optimizer) if fused_update and supports(optimizer) else None
        self.grad_factor: Optional[Factor] = None  # the loss scale the held grads carry (None: unscaled)
        # (scaler steps, scale limit) the factor was made at: the same key means the same value, so a
        # device-tensor factor is compared without a host read; None: unknown, re-base at the next backward
        self._factor_key: Optional[Tuple[int, Optional[float]]] = None
        self._found: Optional[Tensor] = None
        self.skipped = 0
        self._late = _LateSkip()
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
        """Some param of the optimizer requires grad now (read from the params: unfreezing counts)."""
        return any(p.requires_grad for p in optimizer_params(self.optimizer))

    # ---- grads ------------------------------------------------------------------------

    def rebase(self, scale: Factor, shared: bool, limit: Optional[float] = None) -> None:
        """Before a backward at ``scale`` (this scaler's scale capped at ``limit``, see
        :meth:`~lightning_amp.amp.engine.AmpEngine.scale_loss`): re-base grads already held at another
        factor onto it. ``shared``: the scale is the minimum over several optimizers (always re-based)."""
        if self.flat is not None and not self.flat.views_intact():
            self.flat.rebind()  # e.g. after zero_grad(set_to_none=True): autograd must add into the views
        self._late.new_backward(self)
        factor, key = self.grad_factor, (self.scaler.steps, limit)
        if factor is not None and (shared or self._factor_key != key or
                                   (isinstance(factor, float) and factor != scale)):
            grads = optimizer_grads(self.optimizer)
            if grads:
                ratio = scale / factor
                torch._foreach_mul_(grads, ratio if isinstance(ratio, Tensor) else float(ratio))
        self.grad_factor = scale.clone() if isinstance(scale, Tensor) else scale
        self._factor_key = key
        self._found = None

    def hold_grads_at(self, factor: Factor) -> None:
        """The grads held now carry the loss scale ``factor`` (made before this optimizer was connected,
        at another scaler's scale: the next backward re-bases them)."""
        self.grad_factor = factor.clone() if isinstance(factor, Tensor) else factor
        self._factor_key = None

    def _check(self, inv: Factor) -> Tensor:
        grads, = local_shards(optimizer_grads(self.optimizer))  # DTensor grads (FSDP2): this rank's shards
        if self.flat is not None and self.flat.views_intact() and len(grads) == len(self.flat.params):
            grads = list(self.flat.buffers.values())  # one tensor per buffer
        device = grads[0].device if grads else next(iter(self._devices), torch.device("cpu"))
        found = torch.zeros((), dtype=torch.float32, device=device)
        if not grads:
            return found
        by_device = {device: grads} if len(self._devices) <= 1 else _by_device(grads)
        for dev, tensors in by_device.items():
            flag = found if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
            if isinstance(inv, float) and inv == 1.0:  # nothing to unscale: only read the grads
                check_finite(tensors, flag)
            else:
                inv_t = inv.to(dev) if isinstance(inv, Tensor) else torch.full((), inv, dtype=torch.float32,
                                                                                device=dev)
                check_and_unscale_(tensors, flag, inv_t)
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
        for p in optimizer_params(self.optimizer):
            p.grad = None
        if self.flat is not None:
            self.flat.zero_()  # re-attaches the views, zeroed
        self.grad_factor = None

    # ---- the step ---------------------------------------------------------------------

    def step(self, after_unscale: Callable[[], None], grads_read: bool, **step_kwargs: Any) -> None:
        """One optimizer step once the backward(s) ran, read top to bottom: settle the deferred scheduler calls (they
        set the ``lr`` the kernels read), unscale the grads (or, when nothing reads them and the optimizer unscales
        in its own kernel, only check them), agree on overflow across ranks, ``after_unscale()`` (hooks, clipping),
        then :meth:`apply`: step or skip on the device.

        ``grads_read``: ``after_unscale`` may read the grads (a user hook, a callback, clipping); they are then always
        unscaled first. Only when nothing reads them and the optimizer unscales in its own kernel (the ``protocol``
        driver: FusedAdam & co., torch ``fused=True``) are they merely checked and handed over still scaled, saving a
        write pass over the grads."""
        self.gate.settle_deferred()
        factor = self.grad_factor
        in_kernel = (not grads_read and self.driver == "protocol" and factor is not None
                     and not (isinstance(factor, float) and factor == 1.0))
        found_inf = agree(self.inspect() if in_kernel else self.unscale())
        after_unscale()
        self.apply(found_inf, in_kernel, **step_kwargs)

    def _state_incomplete(self) -> bool:
        """A protocol optimizer that is not ours may create state on a skipped first step."""
        if creates_state_only_on_clean_steps(self.optimizer):
            return False
        return len(self.optimizer.state) < sum(len(g["params"]) for g in self.optimizer.param_groups)

    @torch.no_grad()
    def apply(self, found_inf: Tensor, in_kernel: bool, **step_kwargs: Any) -> None:
        """Step (or skip, on the device) with the agreed ``found_inf``, update the scale, report the flag.
        ``in_kernel``: the grads were only inspected and the optimizer unscales them (protocol driver)."""
        if "closure" in step_kwargs and self.scaler.scales_the_loss:  # as GradScaler.step calls it
            step_kwargs = {key: value for key, value in step_kwargs.items() if key != "closure"}
        params = [p for p in optimizer_params(self.optimizer) if p.grad is not None]
        # per-param flags on the device only when the flag may land after these grads are gone (a GPU,
        # a simulated lag); a CPU flag lands inside record() below, and _skipped reads the grads then
        at_once = found_inf.device.type == "cpu" and self.gate.lands_at_once
        flags = None if at_once else _nonfinite_flags(params)
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
        else:
            self.optimizer.step(**step_kwargs)
        # unscaled now (in the kernel too: written back, as torch's fused optimizers); on a skipped step they
        # are dropped when the flag lands, or zeroed before the next backward (_LateSkip)
        self.grad_factor = None
        self._found = None
        self.scaler.update(found_inf)
        report = self.scaler.report_tensor()
        if flags is not None:
            report = torch.cat([report, flags.to(report.device)])
        self.gate.record(found_inf, report, self._late.stepped(found_inf, params))

    def _skipped(self, context: Tuple[int, List[Tensor]], report: Sequence[float]) -> None:
        """A skipped step's flag landed with its ``report`` (host copy of the scaler's report and the
        per-param flags of that step): count it, report it, drop its grads unless a newer backward has
        begun since (those grads belong to the next step; see :class:`_LateSkip`)."""
        generation, params = context
        self.skipped += 1
        if self._on_skip is not None:
            flags = report[2:]
            if len(flags) != len(params):  # landed at once (see apply): these are still the step's grads
                now = _nonfinite_flags(params)
                flags = [] if now is None else now.tolist()
            self._on_skip(self, SkipReport(self.nonfinite_params(params, flags), float(report[0]),
                                           int(report[1])))
        if generation == self._late.generation:
            self.clear_grads()

    def nonfinite_params(self, params: Sequence[Tensor], flags: Sequence[float]) -> List[Tensor]:
        """The model params among ``params`` (a step's params with grads) whose ``flags`` (host copies
        of that step's per-param non-finite flags) are set."""
        return [p for p, flag in zip(params, flags) if flag]


class SkipReport(NamedTuple):
    """What ``on_skip`` learns of one skipped step, taken on the device at that step."""

    params: List[Tensor]  #: the model params whose grads held inf/nan (this rank's view)
    loss_scale: float  #: the scale after that step's update
    overflows_in_a_row: int  #: counted up to and including that step


def _nonfinite_flags(params: Sequence[Tensor]) -> Optional[Tensor]:
    """On the device, a flag per param of ``params`` (all with grads): 1.0 where its grad holds inf/nan;
    one multi-tensor max-abs pass, no host read (None for no params)."""
    if not params:
        return None
    grads = [real_values(g) for g in local_shards([p.grad for p in params])[0]]
    device = grads[0].device
    peaks = torch.stack([peak.to(device) for peak in torch._foreach_norm(grads, float("inf"))])
    return torch.logical_not(torch.isfinite(peaks)).float()


class _LateSkip:
    """Which grads a late skip may touch. Each backward starts a new grad generation; each step
    records the generation it stepped on. When a skipped step's flag lands before the next backward,
    its grads are dropped on the host (:meth:`OptimizerStep.clear_grads`); when the next backward
    begins first, grads still held from the step are zeroed on the device where it was skipped
    (no host read), and the late flag leaves the newer grads alone."""

    def __init__(self) -> None:
        self.generation = 0
        self._found: Optional[Tensor] = None  # the flag of the last step, until the next backward

    def stepped(self, found_inf: Tensor, params: List[Tensor]) -> Tuple[int, List[Tensor]]:
        """After a step on ``params``: the context its gate record carries."""
        self._found = found_inf
        return self.generation, params

    def new_backward(self, state: OptimizerStep) -> None:
        found, self._found = self._found, None
        if found is not None and state.gate.last_step_skipped() is None:
            for grad in optimizer_grads(state.optimizer):
                (grad._values() if grad.is_sparse else grad).masked_fill_(found.to(grad.device) != 0, 0)
        self.generation += 1


def _by_device(tensors: List[Tensor]) -> Dict[torch.device, List[Tensor]]:
    out: Dict[torch.device, List[Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
