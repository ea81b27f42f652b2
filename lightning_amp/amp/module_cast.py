"""Casting a model for O0/O2/O3, in place, framework-free.

* :func:`cast_module_` casts every floating param and buffer to ``dtype`` *in place* (the
  Parameter objects survive, so wrappers such as DDP that hold them keep working). With
  ``keep_batchnorm_fp32`` every ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, ...) stays
  fp32 and gets hooks that run it on an fp32 copy of its input and hand back the input's dtype,
  so a half network with fp32 BatchNorm still flows half activations.
* :func:`cast_outputs_hook` makes a module's floating outputs a fixed dtype (apex's
  ``cast_model_outputs``).
* :func:`cast_floating` casts the floating tensors of any nested collection (inputs).

Calling these twice on one module is harmless: hooks are installed once.
"""
from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

_BN_HOOKS_ATTR = "_lightning_amp_fp32_batchnorm_hooks"
_OUTPUT_HOOK_ATTR = "_lightning_amp_output_cast_hook"


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating tensor (in tuples, lists, dicts, nested) cast to ``dtype``."""
    if isinstance(data, Tensor):
        return data.to(dtype) if data.is_floating_point() and data.dtype != dtype else data
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(cast_floating(item, dtype) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floating(item, dtype) for item in data)
    if isinstance(data, dict):
        return type(data)((key, cast_floating(value, dtype)) for key, value in data.items())
    return data


def _cast_tensor(dtype: torch.dtype, tensor: Tensor) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _bn_input_to_fp32(module: nn.Module, args: tuple) -> tuple:
    module._lightning_amp_input_dtype = args[0].dtype if args and isinstance(args[0], Tensor) else None
    return cast_floating(args, torch.float32)


def _bn_output_to_input_dtype(module: nn.Module, args: tuple, output: Any) -> Any:
    dtype = getattr(module, "_lightning_amp_input_dtype", None)
    return output if dtype is None else cast_floating(output, dtype)


def _keep_fp32_batchnorm(module: _BatchNorm) -> None:
    if getattr(module, _BN_HOOKS_ATTR, None) is not None:
        return
    pre = module.register_forward_pre_hook(_bn_input_to_fp32)
    post = module.register_forward_hook(_bn_output_to_input_dtype)
    setattr(module, _BN_HOOKS_ATTR, (pre, post))


def cast_module_(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool = False) -> nn.Module:
    """Cast ``module``'s floating params and buffers to ``dtype`` in place and return it.

    With ``keep_batchnorm_fp32`` BatchNorm layers are cast to fp32 instead (never rounded
    through ``dtype``) and wrapped by hooks so they compute in fp32 and return half outputs.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"cast_module_: `module` must be a torch.nn.Module, got {type(module).__name__}")
    for sub in module.modules():
        keep_fp32 = keep_batchnorm_fp32 and isinstance(sub, _BatchNorm)
        cast = partial(_cast_tensor, torch.float32 if keep_fp32 else dtype)
        if "recurse" in inspect.signature(sub._apply).parameters:
            sub._apply(cast, recurse=False)
        else:  # e.g. torchmetrics.Metric overrides _apply(fn) without `recurse` (and keeps its states' dtype)
            sub._apply(cast)
        if keep_fp32:
            _keep_fp32_batchnorm(sub)
    return module


def _cast_output(dtype: torch.dtype, module: nn.Module, args: tuple, output: Any) -> Any:
    return cast_floating(output, dtype)


def cast_outputs_hook(module: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Make ``module``'s floating outputs ``dtype`` (a forward hook; ``None`` removes it)."""
    handle = getattr(module, _OUTPUT_HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
        setattr(module, _OUTPUT_HOOK_ATTR, None)
    if dtype is not None:
        setattr(module, _OUTPUT_HOOK_ATTR, module.register_forward_hook(partial(_cast_output, dtype)))
