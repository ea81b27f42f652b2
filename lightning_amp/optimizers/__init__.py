"""Fused optimizers: one kernel call per (param group, device, dtype), in-kernel unscaling."""
from lightning_amp.optimizers.adadelta import FusedAdadelta
from lightning_amp.optimizers.adam import FusedAdam
from lightning_amp.optimizers.lamb import FusedLAMB
from lightning_amp.optimizers.sgd import FusedSGD

__all__ = ["FusedAdadelta", "FusedAdam", "FusedLAMB", "FusedSGD"]
