"""Views of an optimizer's params and grads, framework-free.

Under every opt level the optimizer's ``param_groups`` hold the module's own params (under O2 they
are fp32 and autocast gives forward their half copies, :mod:`lightning_amp.amp.forward`; the former
private fp32 masters are gone). These helpers read those params and their grads for the step path and
its messages.
"""
from __future__ import annotations

from typing import Dict, Iterator, List

import torch
from torch import Tensor


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every param of ``optimizer``, group by group."""
    for group in optimizer.param_groups:
        yield from group["params"]


def optimizer_grads(optimizer: torch.optim.Optimizer) -> List[Tensor]:
    """The existing ``.grad`` tensors of ``optimizer``'s params (params without grad are left out)."""
    return [p.grad for p in optimizer_params(optimizer) if p.grad is not None]


def param_name(names: Dict[Tensor, List[str]], param: Tensor) -> str:
    """The first of ``param``'s names in ``names``, or a placeholder naming its shape."""
    return names.get(param, [f"<unnamed {tuple(param.shape)}>"])[0]
