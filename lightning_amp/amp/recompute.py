"""Forwards re-run inside backward (activation checkpointing) see the dtypes their forward saw.

``torch.utils.checkpoint`` (and Hugging Face's ``gradient_checkpointing_enable()``, which uses it)
re-runs parts of the forward during backward, outside the plugin's forward context. torch restores
the autocast and RNG state of the original forward there, not what a level adds on top
(:func:`~lightning_amp.amp.forward.recompute_state`):

* O2's op policy (:mod:`~lightning_amp.amp.o2.policy`), which is per thread: the recompute would
  upcast norms and softmax where forward kept them half;
* O3's half default dtype: tensors made without a dtype would be fp32.

Non-reentrant checkpointing then refuses the recomputed tensors (their dtype differs from the ones
saved in forward); reentrant checkpointing would silently differentiate another function than the
one that produced the loss.

:func:`recompute_context` wraps a backward call. The first module forward that starts inside it (on
any thread: a CUDA backward runs on the device's autograd thread) enters the level's state, every
module forward inside it joins its thread to that state, and the state holds until the backward
returns. Only forwards that autograd's backward runs count (``torch._C._current_graph_task_id()``, as
torch's checkpoint tells them apart): a forward another thread runs meanwhile is left alone. A backward that recomputes nothing pays for registering and removing one global forward
pre-hook. What O1 adds to autocast (functions registered with :mod:`~lightning_amp.amp.casts`) is not
re-applied in a recompute: keep such calls outside checkpointed regions. Ops of a checkpointed
function that run before its first module forward are not covered either.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Protocol, Set

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from lightning_amp.amp.process_state import CountedElsewhere


class RecomputeState(Protocol):
    """A level's forward state for recomputed forwards."""

    def enter(self) -> None:
        """On the thread of the first recomputed module forward."""

    def join(self) -> None:
        """On the thread of every recomputed module forward (after :meth:`enter`)."""

    def exit(self) -> None:
        """On the thread that called backward, when it returns."""


def _graph_task_id() -> int:
    """The id of the backward the calling thread is executing, -1 outside one (how torch's own
    non-reentrant checkpoint tells a recompute apart)."""
    return torch._C._current_graph_task_id()


_open_hooks: Set[object] = set()  # the global hooks of the recompute contexts open now (every thread)
CountedElsewhere("global module forward pre-hooks (a recomputing backward)", lambda: len(_open_hooks))


@contextlib.contextmanager
def recompute_context(state: RecomputeState) -> Iterator[None]:
    """Around a backward: module forwards re-run inside it get ``state`` (see the module docstring)."""
    lock, entered = threading.Lock(), [False]

    def enter_state(module: nn.Module, args: tuple) -> None:
        if _graph_task_id() == -1:
            return  # not run by autograd's backward: another thread's forward, not a recompute
        with lock:
            if not entered[0]:
                entered[0] = True
                state.enter()
        state.join()

    hook = register_module_forward_pre_hook(enter_state)
    _open_hooks.add(hook)
    try:
        yield
    finally:
        hook.remove()
        _open_hooks.discard(hook)
        with lock:
            if entered[0]:
                state.exit()
