"""The context every forward of an opt level runs in.

* O0: nothing.
* O1: ``torch.autocast(dtype)`` plus the registered cast lists (:func:`~lightning_amp.amp.casts.cast_context`:
  ``register_*_function``, RNNs in fp32 on CPUs without a half RNN kernel, fp16 BCE refused).
* O2: the same, over the module's own fp32 Parameters, so every op reconciles dtypes
  exactly as under Lightning's ``bf16-mixed``: ``module.weight`` is the Parameter inside forward as
  outside, writes to it are seen by the next op, ``torch.func.functional_call`` and deep copies work,
  and an fp32 class weight, mask or buffer meets half activations without a dtype error. With
  ``norm_policy="half"`` (the default) O2's op policy is active on the thread
  (:mod:`~lightning_amp.amp.o2.policy`): norms, softmax and the math autocast would upcast run in the
  activations' half dtype, embeddings are cast to half, and an fp32 tensor that is no activation of the
  stream (a Parameter, any view or expression of Parameters, a buffer, a mask) meeting a half activation
  gives a half result (computed in fp32, rounded once), as under ``bf16-true``; losses stay fp32.
  ``norm_policy="fp32"`` leaves autocast's lists as they are.
* O3: the half ``dtype`` is torch's *default dtype* (the model is half, as under Lightning's
  ``bf16-true``: tensors made without a dtype meet half weights); no autocast.

Autocast runs with its weight cache off, as Lightning's Trainer precision does: each op casts the
Parameter it reads, so a write to a weight inside a step (a WGAN clip, an optimizer step under manual
optimization, ``toggle_optimizer``) is what the next op sees.

:func:`recompute_state` is what a forward re-run inside backward (activation checkpointing) must get
back beyond what torch restores itself (autocast): see :mod:`~lightning_amp.amp.recompute`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from lightning_amp.amp import function_backward
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.casts import cast_context
from lightning_amp.amp.levels import AmpProperties
from lightning_amp.amp.module_cast import default_dtype
from lightning_amp.amp.recompute import RecomputeState


def uses_o2_policy(props: AmpProperties) -> bool:
    """Whether the level's forward applies O2's op policy (O2 with ``norm_policy="half"``)."""
    return props.opt_level == "O2" and props.norm_policy == "half"


@contextlib.contextmanager
def forward_context(props: AmpProperties, device_type: str) -> Iterator[None]:
    """The forward context of the level ``props`` on a device of type ``device_type`` ("cpu", "cuda", ...).
    O2's op policy applies only where :func:`~lightning_amp.amp.o2.policy.hold` registered it."""
    if props.autocast:
        with torch.autocast(device_type, dtype=props.dtype, cache_enabled=False), cast_context(props.dtype, device_type):
            if uses_o2_policy(props):
                with o2_policy.forward(), function_backward.autocast_backward():
                    yield
            else:
                yield
    elif props.cast_model:
        with default_dtype(props.dtype):
            yield
    else:
        yield


class _DefaultDtype:
    """O3's half default dtype for recomputed forwards (process-wide)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype, self._previous = dtype, None

    def enter(self) -> None:
        self._previous = torch.get_default_dtype()
        torch.set_default_dtype(self._dtype)

    def join(self) -> None:
        pass

    def exit(self) -> None:
        if self._previous is not None:
            torch.set_default_dtype(self._previous)
            self._previous = None


def recompute_state(props: AmpProperties) -> Optional[RecomputeState]:
    """What forwards re-run inside a backward need beyond torch's restored autocast: O2's op policy (on
    the recomputing threads), O3's half default dtype; None for the other levels."""
    if uses_o2_policy(props):
        return o2_policy.SharedForward()
    if props.cast_model and not props.autocast:
        return _DefaultDtype(props.dtype)
    return None
