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
any thread: a CUDA backward runs on the device's autograd thread) enters the level's shared forward
state (:func:`~lightning_amp.amp.forward.shared_forward_state`: the half default dtype and, under
master weights, the half copies of every param and the input casts), which then holds until the
backward returns. A backward that recomputes nothing pays for registering and removing one global
forward pre-hook. While it holds, the half copies take 2 bytes per param, as in forward. O1's casts
are autocast's, which torch restores; what O1 adds on top (functions registered with
:mod:`~lightning_amp.amp.casts`, RNNs run in fp32 on CPUs without a half RNN kernel) is thread-local
to the forward and not re-applied in a recompute: keep such calls outside checkpointed regions.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager, Iterator

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook


@contextlib.contextmanager
def recompute_context(forward_state: Callable[[], ContextManager]) -> Iterator[None]:
    """Around a backward: the first module forward re-run inside it enters ``forward_state()``
    (a process-wide context: any thread may enter it, the caller's thread leaves it), held until
    the block ends."""
    with contextlib.ExitStack() as state:
        lock, waiting = threading.Lock(), [True]

        def enter_forward_state(module: nn.Module, args: tuple) -> None:
            with lock:
                if not waiting[0]:
                    return
                waiting[0] = False
                hook.remove()
                state.enter_context(forward_state())

        hook = register_module_forward_pre_hook(enter_forward_state)
        try:
            yield
        finally:
            with lock:
                if waiting[0]:
                    waiting[0] = False
                    hook.remove()
