"""A model that is tensor-parallel already (torch's ``parallelize_module`` / ``distribute_module``) is refused before
``tp_fused`` changes anything: it splits plain models itself and cannot split DTensor shards again (torch's own error
comes later, from deep inside the setup: ``c10d.broadcast_.default does not have a sharding strategy registered``)."""
from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.tensor import DTensor

_TORCH_TP = "torch.distributed.tensor"  # the package whose hooks parallelize_module and distribute_module install


def _hook_from_torch_tp(module: nn.Module) -> Optional[str]:
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for hook in hooks.values():
            where = getattr(hook, "__module__", None) or ""
            if where.startswith(_TORCH_TP):
                return getattr(hook, "__qualname__", repr(hook)).split(".<locals>")[0]
    return None


def already_parallel(module: nn.Module) -> Optional[str]:
    """What makes ``module`` tensor-parallel already, naming the first such parameter, buffer or module, or None."""
    for kind, named in (("parameter", module.named_parameters), ("buffer", module.named_buffers)):
        for name, tensor in named():
            if isinstance(tensor, DTensor):
                return (f"its {kind} {name!r} is a DTensor (placements {tuple(tensor.placements)} on a device mesh of "
                        f"{tensor.device_mesh.size()} rank(s))")
    for name, sub in module.named_modules():
        hook = _hook_from_torch_tp(sub)
        if hook:
            return f"its module {name or type(module).__name__!r} carries a hook of torch's tensor parallelism ({hook})"
    return None


def refuse_already_parallel(module: nn.Module) -> None:
    """ValueError, before anything is changed, when ``module`` is tensor-parallel already (see :func:`already_parallel`)."""
    why = already_parallel(module)
    if why is not None:
        raise ValueError(
            f"strategy='tp_fused': {type(module).__name__} is tensor-parallel already: {why}. tp_fused splits a plain "
            "model itself and cannot split DTensor shards again. Either drop your parallelize function "
            "(parallelize_module / distribute_module) and let tp_fused split the plain model (plan='auto', or "
            "plan={'glob': 'column'|'row'} to choose the layers), or keep it and train with Lightning's "
            "ModelParallelStrategy instead of tp_fused. Nothing was changed.")

