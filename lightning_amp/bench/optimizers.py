"""Which optimizer a benchmark run trains with: the example's own, or lightning-amp's FusedAdam in its place.

``"fused-adam"`` makes the example's ``configure_optimizers`` build :class:`~lightning_amp.FusedAdam`
wherever it builds ``torch.optim.Adam`` or ``torch.optim.AdamW``, with the same param groups and
hyperparameters (torch's defaults where the example gives none), so its LR schedulers bind to the
FusedAdam and nothing else about the run changes.
"""
from __future__ import annotations

import torch

from lightning_amp.bench.choices import OPTIMIZERS


def _fused(adam_w_mode: bool, default_weight_decay: float):
    def build(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=default_weight_decay, amsgrad=False):
        from lightning_amp.optimizers import FusedAdam

        return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adam_w_mode=adam_w_mode)
    return build


def use_optimizer(module, choice: str) -> None:
    """Make ``module`` (a LightningModule) train with ``choice`` (one of :data:`OPTIMIZERS`), in place."""
    if choice not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {choice!r}")
    if choice == "example":
        return
    original = module.configure_optimizers

    def configure_optimizers():
        saved = torch.optim.Adam, torch.optim.AdamW
        torch.optim.Adam, torch.optim.AdamW = _fused(False, 0.0), _fused(True, 1e-2)
        try:
            return original()
        finally:
            torch.optim.Adam, torch.optim.AdamW = saved

    module.configure_optimizers = configure_optimizers
