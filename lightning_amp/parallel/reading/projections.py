"""The layers the tensor-parallel plan splits: ``nn.Linear`` and ``transformers``' ``Conv1D``."""
from __future__ import annotations

from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a Linear storing its weight as ``[in, out]`` (``nx``, ``nf``). Reads the module's
    dicts, not ``getattr``, which ``torch.fx`` replaces while it traces."""
    if type(module).__name__ != "Conv1D":
        return False
    weight = module._parameters.get("weight")
    return isinstance(vars(module).get("nf"), int) and weight is not None and tuple(weight.shape) == (module.nx, module.nf)


def is_projection(module: nn.Module) -> bool:
    """A layer the plan can split: ``nn.Linear`` or ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def widths_of(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a projection."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features, module.out_features)
