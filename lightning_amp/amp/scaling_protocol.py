"""The in-kernel loss-scaling protocol between the step path (:mod:`lightning_amp.amp.step`) and an optimizer.

An optimizer with ``_step_supports_amp_scaling = True`` (torch's ``fused=True`` optimizers, lightning-amp's
fused ones) takes ``grad_scale`` (the factor its grads carry) and ``found_inf`` (a non-zero 0-dim device
tensor: skip) as ``torch.amp.GradScaler`` hands them, and unscales and skips inside its own kernel.
:class:`InKernelScaling` is the marker lightning-amp's fused optimizers carry
(:class:`lightning_amp.optimizers.base.FusedOptimizer` derives from it); the step path asks these
functions, so it imports no optimizer.
"""
from __future__ import annotations

import torch


class InKernelScaling:
    """Mixin of an optimizer that unscales in its kernel and reads ``found_inf`` before it creates any
    state: a skipped first step leaves it without state, so the step path never reads the flag on the host
    for it (:func:`creates_state_only_on_clean_steps`)."""

    _step_supports_amp_scaling = True
    #: True: a skipped step (``found_inf`` non-zero) creates no optimizer state
    _creates_state_only_on_clean_steps = True


def unscales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer divides by ``grad_scale`` and honours ``found_inf`` inside its own step."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def creates_state_only_on_clean_steps(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer reads ``found_inf`` itself before creating state (an :class:`InKernelScaling` one);
    any other protocol optimizer may create state on a skipped first step."""
    return bool(getattr(optimizer, "_creates_state_only_on_clean_steps", False))
