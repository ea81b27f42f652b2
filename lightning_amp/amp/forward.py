"""The context every forward of an opt level runs in.

* O0: nothing.
* O1: ``torch.autocast(dtype)`` plus the registered cast lists (:func:`~lightning_amp.amp.casts.cast_context`).
* O2 and O3 (the model is half, or under master weights sees half copies of its fp32 params,
  :mod:`~lightning_amp.amp.half_params`): the half ``dtype`` is torch's *default dtype* during forward, as
  Lightning's ``bf16-true`` / ``16-true`` do, so tensors the model creates there without a dtype
  (``torch.zeros(...)`` tables, ``torch.ones(...)`` masks, lazily built buffers) are half and
  meet half weights. What the default dtype cannot reach — tensors made fp32 on purpose
  (``torch.arange(n).float()``, ``dtype=torch.float32``, masks built from a Hugging Face model's
  ``self.dtype``, which reads the fp32 Parameters) — is handled per level:

  - O2 (master weights) casts them where they enter a module (:mod:`~lightning_amp.amp.half_inputs`):
    fp32 inputs of every submodule become half (saturating, so fp32 masks stay finite), loss modules
    compute in fp32, fp32 buffers registered during forward are stored half. It does *not* run under
    ``torch.autocast``, on any device: on CUDA autocast's fp32 list (``layer_norm``, ``softmax``,
    ``sum``, ``pow``, ...) would upcast the activations at every LayerNorm and softmax, and one
    mechanism on every device is the one the CPU test suite proves. BatchNorm stays fp32 (its hooks
    hand it fp32 input).
  - O2 without master weights (no module reaches this function) keeps ``torch.autocast(dtype)``.
  - O3 stays pure half (no autocast, no input casts), exactly Lightning's ``bf16-true``.

The previous default dtype is restored on exit, also on error. torch's default dtype is
process-wide (not per thread), as it is for Lightning's half-true precision.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from lightning_amp.amp.casts import cast_context
from lightning_amp.amp.half_inputs import half_inputs
from lightning_amp.amp.half_params import HalfParams
from lightning_amp.amp.levels import AmpProperties
from lightning_amp.amp.module_cast import default_dtype


@contextlib.contextmanager
def shared_forward_state(props: AmpProperties, half_params: Optional[HalfParams] = None) -> Iterator[None]:
    """The process-wide part of the level's forward: the half default dtype (O2, O3) and, under
    master weights, the half copies and the input casts. It holds on every thread, so a forward that
    activation checkpointing re-runs inside backward (on the device's autograd thread on CUDA) can be
    given it again (:mod:`~lightning_amp.amp.recompute`); the thread-local rest (autocast) torch
    restores there itself. Nothing for O0 and O1."""
    if half_params is not None:
        with half_params, default_dtype(props.dtype), \
                half_inputs(half_params.module, props.dtype, props.keep_batchnorm_fp32):
            yield
    elif props.cast_model:
        with default_dtype(props.dtype):
            yield
    else:
        yield


def has_shared_forward_state(props: AmpProperties, half_params: Optional[HalfParams] = None) -> bool:
    """Whether :func:`shared_forward_state` does anything for this level."""
    return half_params is not None or props.cast_model


@contextlib.contextmanager
def forward_context(props: AmpProperties, device_type: str, half_params: Optional[HalfParams] = None) -> Iterator[None]:
    """The forward context of the level ``props`` on a device of type ``device_type`` ("cpu", "cuda", ...).

    ``half_params``: under master weights, the model's fp32 params are seen as these half copies
    inside the block (:class:`~lightning_amp.amp.half_params.HalfParams`)."""
    if half_params is None and props.autocast:
        with torch.autocast(device_type, dtype=props.dtype, cache_enabled=False):
            with cast_context(props.dtype, device_type):
                yield
        return
    with shared_forward_state(props, half_params):
        if half_params is None and props.cast_model and props.opt_level == "O2":
            with torch.autocast(device_type, dtype=props.dtype, cache_enabled=False):
                yield
        else:
            yield
