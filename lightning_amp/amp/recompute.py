"""Forwards re-run inside backward (activation checkpointing) see the dtypes their forward saw.

``torch.utils.checkpoint`` (and Hugging Face's ``gradient_checkpointing_enable()``, which uses it)
re-runs parts of the forward during backward, outside the plugin's forward context. torch
restores the autocast and RNG state of the original forward there, not what a level adds on top:

* O2's half copies of the fp32 Parameters (:mod:`~lightning_amp.amp.half_params`): the recompute
  would read the fp32 Parameters,
* O2's and O3's half default dtype (:mod:`~lightning_amp.amp.forward`): tensors made without a
  dtype would be fp32.

Non-reentrant checkpointing then refuses the recomputed tensors (their dtype differs from the ones
saved in forward); reentrant checkpointing would silently differentiate an fp32 function instead of
the half one that produced the loss.

:func:`recompute_context` wraps a backward call. The first module forward that starts inside it (on
any thread: a CUDA backward runs on the device's autograd thread) switches to the level's forward
state — the half default dtype and, under master weights, the half copies of every param — which
then holds until the backward returns. A backward that recomputes nothing pays for registering and
removing one global forward pre-hook. While it holds, the half copies take 2 bytes per param, as in
forward. O1's casts are autocast's, which torch restores; what O1 adds on top (functions registered
with :mod:`~lightning_amp.amp.casts`, RNNs run in fp32 on CPUs without a half RNN kernel) is
thread-local to the forward and not re-applied in a recompute: keep such calls outside checkpointed
regions.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from lightning_amp.amp.half_params import HalfParams
from lightning_amp.amp.module_cast import default_dtype


@contextlib.contextmanager
def recompute_context(dtype: Optional[torch.dtype], half_params: Optional[HalfParams]) -> Iterator[None]:
    """Around a backward: forwards re-run inside it get ``dtype`` as torch's default dtype (``None``:
    leave it) and, if given, ``half_params``' copies installed. Nothing to do when both are ``None``."""
    if dtype is None and half_params is None:
        yield
        return
    with contextlib.ExitStack() as state:
        lock, waiting = threading.Lock(), [True]

        def enter_forward_state(module: nn.Module, args: tuple) -> None:
            with lock:
                if not waiting[0]:
                    return
                waiting[0] = False
                hook.remove()
                if dtype is not None:
                    state.enter_context(default_dtype(dtype))
                if half_params is not None:
                    state.enter_context(half_params)

        hook = register_module_forward_pre_hook(enter_forward_state)
        try:
            yield
        finally:
            with lock:
                if waiting[0]:
                    waiting[0] = False
                    hook.remove()
