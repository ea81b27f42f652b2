"""O2's forward without ``torch.autocast``: fp32 tensors made inside forward reach half modules as half.

Why not autocast: on CUDA its fp32 list (``layer_norm``, ``softmax``, ``log_softmax``, ``sum``,
``pow``, ``exp``, ...) upcasts the activations at every LayerNorm and softmax, and the residual
stream then stays fp32 (what made Lightning's ``bf16-mixed`` 1.36x slower than O2 on an H100
BERT-base). What autocast did for O2 was to let fp32 tensors made inside forward (masks, position
tables, lazily built buffers) meet half weights; this module does that at module boundaries instead.

Contract, while :func:`half_inputs` is entered (O2's forward context: half copies of the params in
place and the half ``dtype`` as torch's default dtype):

* before each submodule of ``root`` runs, the fp32/fp64 tensors among its inputs (positional and
  keyword, also inside tuples and lists) are cast to ``dtype`` *saturating* at the half range
  (:func:`saturate`): an additive attention mask at ``finfo(float32).min`` becomes
  ``finfo(dtype).min``, not ``-inf``, so a fully masked softmax row stays finite (uniform, as in
  fp32) instead of NaN;
* loss modules (``nn.modules.loss._Loss``: ``CrossEntropyLoss``, ``MSELoss``, ...), also those made
  inside forward as Hugging Face heads make them, get their half inputs cast to fp32 instead: the
  loss is computed in fp32 (``_Loss.__call__`` does it while the block is entered: no hook to register
  on a module that is not a submodule of ``root``);
* modules left on fp32 Parameters under O2 (:func:`~lightning_amp.amp.half_params.reads_fp32`: BatchNorm kept fp32, whose own hooks
  hand it fp32 input; sparse-grad embeddings) and torchmetrics metrics with everything inside them
  (their states must not be rounded) are left alone;
* a floating fp32/fp64 buffer registered inside the block (a table built on the first forward) is
  stored as ``dtype``, as :func:`~lightning_amp.amp.half_params.prepare_o2_module_` stores the
  buffers present at setup.

Not reached: an fp32 tensor made inside one module's forward and combined there with half tensors
without crossing a module boundary. An elementwise op promotes (the result is fp32 until the next
module casts it back); a matmul of it with a half weight raises torch's dtype error, as under
Lightning's ``bf16-true``.

Hooks: one forward pre-hook (with kwargs) per module (loss modules excepted), registered on the
first entry and again for modules added since (the walk reruns when
:func:`~lightning_amp.amp.half_params.registration_count` moved); a module-level function, so
pickling and deep copies follow the module. Outside the block it returns at once;
:func:`remove_half_inputs_hooks` takes them off (the next entry puts them back). Host cost: one
Python call per module call. Like the default dtype, the loss-module cast is process-wide while
entered.
"""
from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.loss import _Loss
from torch.nn.modules.module import register_module_buffer_registration_hook

from lightning_amp.amp.half_params import reads_fp32, registration_count
from lightning_amp.amp.module_cast import _is_metric, modules_outside_metrics, remove_hook, saturate

_WIDE = (torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)
_HOOKED_ATTR = "_lightning_amp_half_inputs"
_active: List[torch.dtype] = []  # the half dtype of each entered block, innermost last
_module_counts: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_LOSS_CALL = _Loss.__dict__.get("__call__")  # None: _Loss inherits nn.Module.__call__


def _cast(value: Any, sources: Tuple[torch.dtype, ...], convert: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with its tensors of a ``sources`` dtype converted (tuples and lists searched); the
    same object when nothing changed."""
    if isinstance(value, Tensor):
        return convert(value) if value.dtype in sources else value
    if type(value) in (tuple, list):
        items = _cast_items(value, sources, convert)
        return value if items is None else type(value)(items)
    return value


def _cast_items(values, sources, convert) -> Optional[list]:
    out = None
    for i, value in enumerate(values):
        new = _cast(value, sources, convert)
        if new is not value:
            if out is None:
                out = list(values)
            out[i] = new
    return out


def _cast_call(args: tuple, kwargs: dict, sources, convert) -> Optional[Tuple[tuple, dict]]:
    new_args = _cast_items(args, sources, convert)
    new_kwargs = None
    for key, value in kwargs.items():
        new = _cast(value, sources, convert)
        if new is not value:
            if new_kwargs is None:
                new_kwargs = dict(kwargs)
            new_kwargs[key] = new
    if new_args is None and new_kwargs is None:
        return None
    return (args if new_args is None else tuple(new_args)), (kwargs if new_kwargs is None else new_kwargs)


def _inputs_to_half(module: nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
    if not _active:
        return None
    if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):  # the common call, without the walk
        return None if args[0].dtype not in _WIDE else ((saturate(args[0], _active[-1]),), kwargs)
    return _cast_call(args, kwargs, _WIDE, partial(saturate, dtype=_active[-1]))


def _fp32_loss_call(self: _Loss, *args: Any, **kwargs: Any) -> Any:
    """``_Loss.__call__`` while a block is entered: half inputs cast to fp32, then the module's call."""
    cast = _cast_call(args, kwargs, _HALF, Tensor.float)
    if cast is not None:
        args, kwargs = cast
    return (_LOSS_CALL or nn.Module.__call__)(self, *args, **kwargs)


def _hook_new_modules(root: nn.Module, keep_batchnorm_fp32: bool) -> None:
    count = registration_count()
    if _module_counts.get(root) == count:
        return
    for sub in modules_outside_metrics(root):  # a metric's own networks (FID's Inception, ...) stay as they are
        if sub.__dict__.get(_HOOKED_ATTR) or isinstance(sub, _Loss) or reads_fp32(sub, keep_batchnorm_fp32):
            continue
        sub.register_forward_pre_hook(_inputs_to_half, with_kwargs=True)
        sub.__dict__[_HOOKED_ATTR] = True
    _module_counts[root] = count


def remove_half_inputs_hooks(root: nn.Module) -> None:
    """Take the input-cast hooks off ``root`` and its submodules; the next :func:`half_inputs` entry of
    any root hooks its modules again."""
    for sub in root.modules():
        remove_hook(sub, _inputs_to_half)
        sub.__dict__.pop(_HOOKED_ATTR, None)
    _module_counts.clear()  # other roots sharing these modules must walk again too


def _buffer_to_half(dtype: torch.dtype, keep_batchnorm_fp32: bool, module: nn.Module, name: str,
                    buffer: Optional[Tensor]) -> Optional[Tensor]:
    if buffer is None or buffer.dtype not in _WIDE or _is_metric(module) or reads_fp32(module, keep_batchnorm_fp32):
        return None
    return saturate(buffer, dtype)


@contextlib.contextmanager
def half_inputs(root: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> Iterator[None]:
    """Inside the block, fp32 inputs of ``root``'s submodules and new fp32 buffers become ``dtype``
    (see the module docstring). Nested entries are allowed; the innermost ``dtype`` applies."""
    if dtype not in _HALF:
        raise ValueError(f"half_inputs: `dtype` must be torch.float16 or torch.bfloat16, got {dtype}")
    _hook_new_modules(root, keep_batchnorm_fp32)
    handle = register_module_buffer_registration_hook(partial(_buffer_to_half, dtype, keep_batchnorm_fp32))
    if not _active:
        _Loss.__call__ = _fp32_loss_call
    _active.append(dtype)
    try:
        yield
    finally:
        _active.pop()
        handle.remove()
        if not _active:
            if _LOSS_CALL is None:
                del _Loss.__call__
            else:
                _Loss.__call__ = _LOSS_CALL
