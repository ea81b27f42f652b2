"""AmpEngine: every optimizer of one model under one opt level, framework-free.

Owns one :class:`~lightning_amp.amp.step.OptimizerStep` and one :class:`LossScaler` per optimizer,
the scale of each backward (the smallest among the optimizers whose params require grad; grads
already held at another factor are re-based first, so accumulated grads carry one known factor),
what happens when a skipped step reaches the host (names of the offending params at debug level,
a warning after every ``OVERFLOW_WARN_AFTER`` overflows in a row, the grads dropped), and the
scaler part of checkpoints. The optimizers step the module's own params at every level (under O2
those are fp32 and autocast gives forward their half copies, :mod:`lightning_amp.amp.forward`), so nothing
here maps params to other tensors. The Lightning plugin (``lightning_amp.trainer.precision``) only calls
into it from its hooks.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from lightning_amp.amp.param_views import optimizer_grads, param_name
from lightning_amp.amp.scaler import LossScaler
from lightning_amp.amp.step import OptimizerStep, SkipReport

log = logging.getLogger(__name__)

OVERFLOW_WARN_AFTER = 10
"""Overflows in a row of one optimizer after which (and every so many) a one-line warning is issued."""


def root_scale_limit(dtype: torch.dtype) -> Optional[float]:
    """The largest power of two ``dtype`` holds when that caps a loss scale (2**15 for float16, 2**127
    for bfloat16), None for fp32 and wider: the most a loss of that dtype may be scaled by (see
    :meth:`AmpEngine.scale_loss`)."""
    if not dtype.is_floating_point or torch.finfo(dtype).max >= torch.finfo(torch.float32).max:
        return None
    return 2.0 ** math.floor(math.log2(torch.finfo(dtype).max))


class AmpEngine:
    """The per-model mixed-precision state (see the module docstring).

    The engine holds no copy of the opt level: its owner (:class:`~lightning_amp.amp.runtime.AmpRuntime`)
    resolves the level, possibly again when the device becomes known, and the two callables read it then.

    Args:
        new_scaler: makes the LossScaler of one optimizer (at the level current when it is called).
        check_optimizer: ``check_optimizer(index, optimizer)`` raises ValueError for an optimizer the level
            cannot step (e.g. LBFGS under loss scaling), before it is connected.
        combine_grad, fused_update: as :class:`OptimizerStep`.
        warn: how warnings are issued (the plugin passes a rank-zero warn).
    """

    def __init__(self, new_scaler: Callable[[], LossScaler],
                 check_optimizer: Callable[[int, torch.optim.Optimizer], None] = lambda index, optimizer: None,
                 combine_grad: bool = False, fused_update: bool = True,
                 warn: Callable[[str], None] = warnings.warn) -> None:
        self._new_scaler = new_scaler
        self._check_optimizer = check_optimizer
        self.combine_grad, self.fused_update = combine_grad, fused_update
        self.warn = warn
        self._scalers: List[LossScaler] = []
        self._states: List[OptimizerStep] = []
        self._skipped_before = 0  # skipped steps restored from a checkpoint for optimizers not present
        self._pending_state: Optional[dict] = None
        self.param_names: Dict[Tensor, List[str]] = {}
        self._last_scale: Optional[Union[float, Tensor]] = None  # the scale of the last backward
        #: names of the params whose grads were non-finite at the last skipped step (this rank's view)
        self.last_nonfinite_params: List[str] = []

    def connect(self, optimizers: List[torch.optim.Optimizer], param_names: Dict[Tensor, List[str]]) -> None:
        """A scaler and an OptimizerStep for every optimizer (``param_names``: param -> its names, for messages)."""
        self.param_names = param_names
        self._states = []
        for optimizer in optimizers:
            self.add_optimizer(optimizer)
        if self._pending_state is not None and self._states:
            self._check_scaler_count(self._pending_state["loss_scalers"], len(self._states))
            self._pending_state = None

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """Connect one more optimizer: a scaler (the checkpoint's, and its count of skipped steps, when one was loaded
        before the optimizers connected) and its step."""
        index = len(self._states)
        self._check_optimizer(index, optimizer)
        self._warn_on_vanishing_eps(index, optimizer)
        if index >= len(self._scalers):
            self._scalers.append(self._new_scaler())
        state = self._new_state(optimizer, self._scalers[index], self.combine_grad)
        self._states.append(state)
        skipped = (self._pending_state or {}).get("skipped_per_optimizer", [])
        if index < len(skipped):
            state.skipped = int(skipped[index])
            self._skipped_before -= state.skipped  # counted in the saved total already
        return state

    def step(self, optimizer: torch.optim.Optimizer, after_unscale: Callable[[], None], grads_read: bool,
             **step_kwargs: Any) -> None:
        """One optimizer step once the backward(s) ran: :meth:`OptimizerStep.step` of ``optimizer``'s step (settle,
        unscale or only check, agree across ranks, ``after_unscale()``, step or skip on the device)."""
        self.state_of(optimizer).step(after_unscale, grads_read, **step_kwargs)

    def restart(self) -> None:
        """After a change of level: every optimizer gets a fresh scaler at the level's scale and a fresh step (its
        caches of the optimizer's state, which may have been reloaded, rebuilt; the grads it holds dropped). The
        flags still on their way are waited for first; each optimizer's count of skipped steps carries on."""
        for state in self._states:
            state.gate.poll(wait=True)
        for index, state in enumerate(self._states):
            state.clear_grads()
            self._scalers[index] = self._new_scaler()
            self._states[index] = self._new_state(state.optimizer, self._scalers[index], self.combine_grad)
            self._states[index].skipped = state.skipped
        self._last_scale = None

    @property
    def states(self) -> List[OptimizerStep]:
        return self._states

    @property
    def scalers(self) -> List[LossScaler]:
        return self._scalers

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (all optimizers; waits for the flags still on their way to the host)."""
        for state in self._states:
            state.gate.poll(wait=True)
        return self.settled_skipped_steps

    @property
    def settled_skipped_steps(self) -> int:
        """Skipped steps whose flags have reached the host (no wait)."""
        return self._skipped_before + sum(s.skipped for s in self._states)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "loss_scalers": [s.state_dict() for s in self._scalers],
            "skipped_steps": self.skipped_steps,
            "skipped_per_optimizer": [s.skipped for s in self._states],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Resume the scalers and skipped-step counts. Before any optimizer is connected (Fabric connects each at its
        first step) the scalers are made now, so the backwards before that run at the saved scale, and each optimizer
        gets its own as it connects."""
        self._skipped_before = int(state_dict.get("skipped_steps", 0))
        if self._states:
            self.load_scaler_states(state_dict)
            return
        self._scalers = []
        for saved in state_dict["loss_scalers"]:
            self._scalers.append(self._new_scaler())
            self._scalers[-1].load_state_dict(saved)
        self._pending_state = state_dict

    def _warn_on_vanishing_eps(self, index: int, optimizer: torch.optim.Optimizer) -> None:
        """A half param stepped directly (no master) with an ``eps`` that is 0 in its dtype divides by zero."""
        for group in optimizer.param_groups:
            eps = group.get("eps")
            if not isinstance(eps, float) or eps <= 0:
                continue
            for param in group["params"]:
                if param.dtype in (torch.float16, torch.bfloat16) and torch.tensor(eps, dtype=param.dtype).item() == 0:
                    self.warn(
                        f"lightning_amp: optimizers[{index}] ({type(optimizer).__name__}) steps {param.dtype} params "
                        f"directly with eps={eps}, which is 0 in {param.dtype}: its updates can divide by zero and "
                        "write inf/nan into the params. Use O2 (fp32 master weights) or a larger eps."
                    )
                    return

    def _new_state(self, optimizer: torch.optim.Optimizer, scaler: LossScaler, combine_grad: bool) -> OptimizerStep:
        """The step of ``optimizer``. Connected after a backward (Fabric connects an optimizer at its first
        step; a GAN's second optimizer after the first one's step), the grads it holds were made at that
        backward's scale, which then becomes their factor (grads accumulated over backwards at different
        scales before their optimizer's first step cannot be told apart)."""
        state = OptimizerStep(optimizer, scaler, combine_grad, self.fused_update, on_skip=self._on_skip)
        if self._last_scale is not None and optimizer_grads(optimizer):
            state.hold_grads_at(self._last_scale)
        return state

    def state_of(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the real one
        for state in self._states:
            if state.optimizer is optimizer:
                return state
        # an optimizer the Trainer did not hand to connect(): give it a scaler of its own
        self._check_optimizer(len(self._states), optimizer)
        self._scalers.append(self._new_scaler())
        state = self._new_state(optimizer, self._scalers[-1], False)
        self._states.append(state)
        return state

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the scale of its backward, multiplied in fp32 (a half ``loss`` is upcast first);
        ``loss`` itself at a static scale of 1.

        The backward of a half ``loss`` hands the scale itself, in the loss's dtype, to the half graph as
        the loss's gradient: 2**16, the dynamic scale's start, is inf in float16 (max 65504). The scale of
        such a backward is therefore at most the largest power of two the loss's dtype holds
        (:func:`root_scale_limit`: 2**15 for float16); the scalers of that backward are capped there for
        good (:meth:`LossScaler.cap`), so the scale they report (``plugin.loss_scale``), grow and back off
        from is the factor the grads carry. A half loss upcast by the user (``loss.float() + aux``)
        cannot be told apart from an fp32 one: its first step may overflow and the scale backs off."""
        scale = self.backward_scale(root_scale_limit(loss.dtype))
        if isinstance(scale, Tensor) or scale != 1.0:
            if loss.dtype in (torch.float16, torch.bfloat16):
                loss = loss.float()
            loss = loss * scale
        return loss

    def backward_scale(self, limit: Optional[float] = None) -> Union[float, Tensor]:
        """The scale of the next backward: a float when static, else a device tensor (no host read). With a
        ``limit`` the scalers of this backward are capped at it first (:meth:`LossScaler.cap`). Grads held
        from earlier backwards are re-based onto it."""
        if not self._states:  # no optimizer connected yet: a resumed scale, or 1
            first = self._scalers[0] if self._scalers else None
            scale = 1.0 if first is None else first.static_scale if first.static_scale is not None else first.scale_tensor
            self._last_scale = scale
            return scale
        candidates = self._states
        if len(candidates) > 1:
            candidates = [s for s in self._states if s.requires_grad()] or self._states
        if limit is not None:
            for state in candidates:
                state.scaler.cap(limit)
        scales = [s.scaler.static_scale if s.scaler.static_scale is not None else s.scaler.scale_tensor
                  for s in candidates]
        if len(scales) == 1 or all(isinstance(x, float) for x in scales):
            scale = scales[0] if len(scales) == 1 else min(scales)
        else:
            scale = torch.stack([torch.as_tensor(x, device=candidates[0].scaler.device) for x in scales]).min()
        for state in candidates:
            state.gate.poll()
            state.rebase(scale, shared=len(candidates) > 1, limit=limit)
        self._last_scale = scale
        return scale

    def _on_skip(self, state: OptimizerStep, report: SkipReport) -> None:
        """A skipped step reached the host (possibly steps later): name its non-finite params, log, warn
        every OVERFLOW_WARN_AFTER in a row, all from that step's ``report``."""
        names = [param_name(self.param_names, p) for p in report.params]
        self.last_nonfinite_params = names
        index = self._states.index(state)
        in_a_row = report.overflows_in_a_row
        log.debug("lightning_amp: optimizer %d step skipped for non-finite gradients (loss scale %s); params: %s",
                  index, report.loss_scale, ", ".join(names) or "<on another rank>")
        if in_a_row % OVERFLOW_WARN_AFTER == 0:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            self.warn(
                f"lightning_amp: {in_a_row} optimizer steps in a row skipped for non-finite gradients "
                f"(optimizer {index}, loss scale {report.loss_scale}); non-finite grads in: {shown or 'another rank'}"
            )

    @staticmethod
    def _check_scaler_count(saved: List[Any], count: int) -> None:
        if len(saved) != count:  # restoring part of it would make the resume inexact
            raise ValueError(
                f"lightning_amp: the checkpoint holds the loss scalers of {len(saved)} optimizer(s) but this run has "
                f"{count}; its scaler state belongs to another set of optimizers and cannot be resumed "
                "exactly. Resume with the optimizers the checkpoint was saved with, or delete the entry the precision "
                "plugin saved under its class name from the checkpoint to start the loss scalers afresh."
            )

    def load_scaler_states(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict["loss_scalers"]
        self._check_scaler_count(saved, len(self._scalers))
        for scaler, scaler_state in zip(self._scalers, saved):
            scaler.load_state_dict(scaler_state)
        for state, skipped in zip(self._states, state_dict.get("skipped_per_optimizer", [])):
            state.skipped = int(skipped)
        self._skipped_before -= sum(s.skipped for s in self._states)  # the rest: optimizers not here now
