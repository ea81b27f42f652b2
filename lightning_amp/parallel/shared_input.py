"""One input-gradient collective for the column-parallel layers that read one input (Megatron's count).

Each column-parallel layer's backward all-reduces the gradient of its input over the TP group (reduce-scatters it
under sequence parallelism). Layers that read the *same* input (``q``, ``k``, ``v``; ``gate``, ``up``) would do that
once each: 5 all-reduces per Llama block where Megatron's layers do 2. A :class:`SharedInput` given to the columns of
one unit puts their input into the TP region once (:func:`~lightning_amp.parallel.comm.copy_to_tensor_parallel_region`,
or :func:`~lightning_amp.parallel.comm.gather_from_sequence_parallel_region`) and hands every layer of the unit that
reads that same tensor the same result; the layers then run their GEMM with no collective of their own (the
replicated key/value rows of a fused ``[q | k | v]``, :mod:`~lightning_amp.parallel.fused_qkv`, take the same entry
as its query rows). Autograd sums
their input gradients into the region's output, and the region's backward reduces the sum once: the adjoint of one
copy read several times is the sum of the reads' gradients, so the result equals the layers' own collectives.

A layer given another tensor (an input the unit's other layers do not read) gets a region of its own: the rule is
exact whatever the forward does. With gradients off (no backward) nothing is kept; what is kept are weak references,
so the input is not held past the step. Under ``torch.compile`` the layers take their own collectives (a traced graph
has no object identity to compare).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_amp.parallel import comm


class SharedInput:
    """The TP-region entry shared by the column-parallel layers of one unit, for ``group`` (see the module
    docstring); ``sequence_parallel``: the input arrives split along ``sequence_dim`` and is all-gathered here."""

    def __init__(self, group: Any, sequence_parallel: bool = False, sequence_dim: int = 0) -> None:
        self.group, self.sequence_parallel, self.sequence_dim = group, sequence_parallel, sequence_dim
        self._last: Optional[tuple[weakref.ref, weakref.ref]] = None  # (input, its region output) of this forward

    def __call__(self, x: Tensor) -> Tensor:
        if self._last is not None and self._last[0]() is x:
            entered = self._last[1]()
            if entered is not None:
                return entered
        if self.sequence_parallel:
            entered = comm.gather_from_sequence_parallel_region(x, self.group, self.sequence_dim)
        else:
            entered = comm.copy_to_tensor_parallel_region(x, self.group)
        self._last = (weakref.ref(x), weakref.ref(entered)) if torch.is_grad_enabled() else None
        return entered

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _last=None)

    def __repr__(self) -> str:
        return f"SharedInput(sequence_parallel={self.sequence_parallel}, sequence_dim={self.sequence_dim})"
