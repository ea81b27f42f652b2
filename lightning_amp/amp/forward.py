"""The context every forward of an opt level runs in.

* O0: nothing.
* O1: ``torch.autocast(dtype)`` plus the registered cast lists (:func:`~lightning_amp.amp.casts.cast_context`).
* O2 and O3 (the model is half, or under master weights sees half copies of its fp32 params,
  :mod:`~lightning_amp.amp.half_params`): the half ``dtype`` is torch's *default dtype* during forward, as
  Lightning's ``bf16-true`` / ``16-true`` do, so tensors the model creates there without a dtype
  (``torch.zeros(...)`` tables, ``torch.ones(...)`` masks, lazily built buffers) are half and
  meet half weights. What the default dtype cannot reach — tensors made fp32 on purpose
  (``torch.arange(n).float()``, ``dtype=torch.float32``, fp32 buffers added after the cast) —
  is handled per level:

  - O2 also runs under ``torch.autocast(dtype)``, so it trains what Lightning's ``bf16-mixed``
    trains: autocast casts fp32 operands of matmuls, convolutions and attention to half, and runs
    its float32 ops (losses; on CUDA also softmax, layer_norm, ...) in fp32. The weights forward
    sees are half copies of the fp32 Parameters, BatchNorm fp32 (its hooks hand it fp32 input;
    batch_norm is in no autocast list). Autocast is also what lets models that read their dtype
    from ``parameters()`` (Hugging Face ``self.dtype``: fp32 here) mix fp32 masks with half
    activations.
  - O3 stays pure half (no autocast), exactly Lightning's ``bf16-true``.

  Autocast alone would not do: an fp32 table added to half activations promotes them to fp32,
  and ops outside autocast's lists (CPU layer_norm) then meet half weights.

The previous default dtype is restored on exit, also on error. torch's default dtype is
process-wide (not per thread), as it is for Lightning's half-true precision.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from lightning_amp.amp.casts import cast_context
from lightning_amp.amp.half_params import HalfParams
from lightning_amp.amp.levels import AmpProperties
from lightning_amp.amp.module_cast import default_dtype


@contextlib.contextmanager
def half_forward(dtype: torch.dtype, device_type: str, autocast: bool) -> Iterator[None]:
    """Forward of a model cast to ``dtype``: ``dtype`` is the default dtype, plus autocast if asked."""
    with default_dtype(dtype):
        if not autocast:
            yield
            return
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            yield


@contextlib.contextmanager
def forward_context(props: AmpProperties, device_type: str, half_params: Optional[HalfParams] = None) -> Iterator[None]:
    """The forward context of the level ``props`` on a device of type ``device_type`` ("cpu", "cuda", ...).

    ``half_params``: under master weights, the model's fp32 params are seen as these half copies
    inside the block (:class:`~lightning_amp.amp.half_params.HalfParams`)."""
    if half_params is not None:
        with half_params, half_forward(props.dtype, device_type, autocast=props.opt_level == "O2"):
            yield
    elif props.autocast:
        with torch.autocast(device_type, dtype=props.dtype, cache_enabled=False):
            with cast_context(props.dtype, device_type):
                yield
    elif props.cast_model:
        with half_forward(props.dtype, device_type, autocast=props.opt_level == "O2"):
            yield
    else:
        yield
