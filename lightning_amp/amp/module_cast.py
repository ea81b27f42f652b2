"""Casting a model for O0/O2/O3, in place, framework-free.

* :func:`prepare_o2_module_` prepares a model for O2 with master weights: its Parameters stay (or
  become) fp32, its buffers keep their dtype unless half buffers are asked for.
* :func:`cast_module_` casts every floating param and buffer to ``dtype`` *in place* (the
  Parameter objects survive, so wrappers such as DDP that hold them keep working). Complex
  tensors are left alone, and so is every torchmetrics ``Metric`` (with its submodules): its
  states accumulate sums and counts that must stay exact. A metric also keeps its own ``dtype``
  when moved (``metric.to(device)``, as Lightning's ``self.log`` does) inside the half forward,
  whose default dtype is half: torchmetrics reads its dtype back from a tensor made with the
  default dtype, which then rounds every later ``update`` to half. With
  ``keep_batchnorm_fp32`` every ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, ...) stays
  fp32 and gets hooks that run it on an fp32 copy of its input and hand back the input's dtype,
  so a half network with fp32 BatchNorm still flows half activations.
* :func:`cast_outputs_hook` makes a module's floating outputs a fixed dtype (apex's
  ``cast_model_outputs``).
* :func:`cast_floating` casts the floating tensors of any nested collection (inputs): tuples,
  namedtuples, lists, dicts and mappings of any subclass (``OrderedDict``, ``defaultdict``, HF
  ``ModelOutput``), dataclasses; optionally :func:`saturate`-ing at the half range.

Calling these twice on one module is harmless: hooks are installed once. :func:`remove_cast_hooks_`
takes every hook and patch of this module off again (what the plugin hands back after a run).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from functools import partial
from typing import Any, Iterator, List, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_amp.amp.process_state import CountedElsewhere

_INPUT_DTYPE_ATTR = "_lightning_amp_input_dtype"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make ``dtype`` (a floating torch.dtype) torch's default dtype inside the block."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    _default_dtype_blocks.append(dtype)
    try:
        yield
    finally:
        _default_dtype_blocks.remove(dtype)
        torch.set_default_dtype(previous)


_default_dtype_blocks: List[torch.dtype] = []  # the default_dtype blocks open now (every thread)
CountedElsewhere("torch's default dtype", lambda: len(_default_dtype_blocks))


def saturate(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` cast to the half ``dtype``, values beyond its range (±inf included) clamped to
    ±``finfo(dtype).max``; NaN stays NaN. An additive attention mask at ``finfo(float32).min``
    becomes ``finfo(dtype).min``, not ``-inf``, so a fully masked softmax row stays finite. The
    overflow is fixed in the half result (no full-size fp32 temporary); autograd passes the grad of
    the values in range, as through a clamp."""
    info = torch.finfo(dtype)
    return tensor.to(dtype, copy=True).nan_to_num_(nan=float("nan"), posinf=info.max, neginf=info.min)


def cast_floating(data: Any, dtype: torch.dtype, saturating: bool = False) -> Any:
    """``data`` with every floating tensor (nested in the collections of the module docstring) cast to
    ``dtype`` (with ``saturating``, a half ``dtype``: :func:`saturate`). A container is copied shallowly
    (its class and other fields kept, a mapping or a dataclass without re-running its ``__init__``);
    other objects are returned as they are."""
    if isinstance(data, Tensor):
        if not data.is_floating_point() or data.dtype == dtype:
            return data
        return saturate(data, dtype) if saturating else data.to(dtype)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(cast_floating(item, dtype, saturating) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(cast_floating(item, dtype, saturating) for item in data)
    if isinstance(data, dict):  # OrderedDict, defaultdict, ModelOutput (a dataclass too): kept as the mapping it is
        out = copy.copy(data)
        for key, value in data.items():
            out[key] = cast_floating(value, dtype, saturating)
        return out
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        out = copy.copy(data)
        for field in dataclasses.fields(data):
            object.__setattr__(out, field.name, cast_floating(getattr(data, field.name), dtype, saturating))  # frozen too
        return out
    return data


def _cast_tensor(dtype: torch.dtype, tensor: Tensor) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor  # complex and integer tensors stay


def _is_hook(hook: Any, fn: Any) -> bool:
    return hook is fn or (isinstance(hook, partial) and hook.func is fn)


def has_hook(module: nn.Module, fn: Any) -> bool:
    """Whether ``fn`` (or a ``functools.partial`` of it) is one of ``module``'s forward (pre-)hooks."""
    return any(_is_hook(hook, fn) for hooks in (module._forward_pre_hooks, module._forward_hooks)
               for hook in hooks.values())


def remove_hook(module: nn.Module, fn: Any) -> None:
    """Take ``fn`` (and every ``functools.partial`` of it) off ``module``'s forward (pre-)hooks. Found by
    the function, not by a handle, so it also works on deep copies and unpickled modules."""
    for hooks, flags in ((module._forward_pre_hooks, (module._forward_pre_hooks_with_kwargs,)),
                         (module._forward_hooks, (module._forward_hooks_with_kwargs,
                                                  module._forward_hooks_always_called))):
        for key in [key for key, hook in hooks.items() if _is_hook(hook, fn)]:
            del hooks[key]
            for flag in flags:
                flag.pop(key, None)


def _bn_input_to_fp32(module: nn.Module, args: tuple) -> tuple:
    module.__dict__[_INPUT_DTYPE_ATTR] = args[0].dtype if args and isinstance(args[0], Tensor) else None
    return cast_floating(args, torch.float32)


def _bn_output_to_input_dtype(module: nn.Module, args: tuple, output: Any) -> Any:
    dtype = module.__dict__.get(_INPUT_DTYPE_ATTR)
    return output if dtype is None else cast_floating(output, dtype)


def _keep_fp32_batchnorm(module: _BatchNorm) -> None:
    if has_hook(module, _bn_input_to_fp32):
        return
    module.register_forward_pre_hook(_bn_input_to_fp32)
    module.register_forward_hook(_bn_output_to_input_dtype)


def cast_module_(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool = False) -> nn.Module:
    """Cast ``module``'s floating params and buffers to ``dtype`` in place and return it.

    With ``keep_batchnorm_fp32`` BatchNorm layers are cast to fp32 instead (never rounded
    through ``dtype``) and wrapped by hooks so they compute in fp32 and return half outputs.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"cast_module_: `module` must be a torch.nn.Module, got {type(module).__name__}")
    for sub in modules_outside_metrics(module):
        keep_fp32 = keep_batchnorm_fp32 and isinstance(sub, _BatchNorm)
        cast = partial(_cast_tensor, torch.float32 if keep_fp32 else dtype)
        if "recurse" in inspect.signature(sub._apply).parameters:
            sub._apply(cast, recurse=False)
        else:  # a module overriding _apply(fn) without `recurse` (it recurses itself; casting twice is harmless)
            sub._apply(cast)
        if keep_fp32:
            _keep_fp32_batchnorm(sub)
    return module


@torch.no_grad()
def prepare_o2_module_(module: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool,
                       half_buffers: bool = False) -> nn.Module:
    """O2 with master weights, in place; returns ``module``.

    Every floating Parameter is fp32 (a half one is upcast in place: the Parameter object survives, so
    optimizers and wrappers holding it keep working); forward sees its half copies through autocast
    (:mod:`lightning_amp.amp.forward`). Buffers keep the dtype the model gave them, except: with
    ``half_buffers`` every floating buffer is stored as ``dtype``; BatchNorm's statistics are fp32 with
    ``keep_batchnorm_fp32`` and ``dtype`` without it (it then computes in half). torchmetrics metrics,
    and everything inside them, are left alone.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"prepare_o2_module_: `module` must be a torch.nn.Module, got {type(module).__name__}")
    for sub in outside_metrics(module):
        for param in sub._parameters.values():
            if param is not None and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
        if isinstance(sub, _BatchNorm):
            buffer_dtype = torch.float32 if keep_batchnorm_fp32 else dtype
        elif half_buffers:
            buffer_dtype = dtype
        else:
            continue
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != buffer_dtype:
                sub._buffers[name] = buffer.to(buffer_dtype)
    return module


def _metric_apply(metric: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
    """``Metric._apply`` with the metric's own dtype as torch's default dtype (see the module docstring)."""
    dtype = getattr(metric, "_dtype", None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return type(metric)._apply(metric, fn, *args, **kwargs)
    with default_dtype(dtype):
        return type(metric)._apply(metric, fn, *args, **kwargs)


def _is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric`` (or ``MetricCollection``), recognised without importing torchmetrics."""
    return any(cls.__module__.startswith("torchmetrics.") and cls.__name__ in ("Metric", "MetricCollection")
               for cls in type(module).__mro__)


def _patched(metric: nn.Module) -> bool:
    return isinstance(metric.__dict__.get("_apply"), partial) and metric.__dict__["_apply"].func is _metric_apply


def modules_outside_metrics(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules, each once, leaving out every torchmetrics metric and everything
    inside one; the metrics found keep their own dtype from now on, also through later ``.to(dtype)``
    calls of Lightning or the user (their ``_apply`` runs with the metric's dtype as the default), until
    :func:`remove_cast_hooks_`."""
    for metric in module.modules():
        if _is_metric(metric) and not _patched(metric):
            metric._apply = partial(_metric_apply, metric)  # a partial: deep copies and pickles follow the metric
    return outside_metrics(module)


def outside_metrics(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules, each once, leaving out every torchmetrics metric and everything
    inside one; the metrics are not touched."""
    seen, stack = set(), [module]
    while stack:
        sub = stack.pop()
        if id(sub) in seen or _is_metric(sub):
            continue
        seen.add(id(sub))
        yield sub
        stack.extend(reversed(list(sub.children())))


def _cast_output(dtype: torch.dtype, module: nn.Module, args: tuple, output: Any) -> Any:
    return cast_floating(output, dtype)


def cast_outputs_hook(module: nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Make ``module``'s floating outputs ``dtype`` (a forward hook; ``None`` removes it)."""
    remove_hook(module, _cast_output)
    if dtype is not None:
        module.register_forward_hook(partial(_cast_output, dtype))


def remove_cast_hooks_(module: nn.Module) -> nn.Module:
    """Take off ``module`` and its submodules what this module's functions put there: the output cast,
    the fp32-BatchNorm hooks and the metrics' ``_apply``. The weights keep their dtypes; returns ``module``."""
    for sub in module.modules():
        if _patched(sub):
            del sub.__dict__["_apply"]
        for fn in (_cast_output, _bn_input_to_fp32, _bn_output_to_input_dtype):
            remove_hook(sub, fn)
        sub.__dict__.pop(_INPUT_DTYPE_ATTR, None)
    return module
