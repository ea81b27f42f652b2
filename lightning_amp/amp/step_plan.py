"""StepPlan: the cached partition of an optimizer's params into kernel calls.

One class for both users of the fused kernels: the fused optimizers
(:class:`~lightning_amp.optimizers.base.FusedOptimizer`) and the kernel step of a user's torch Adam/AdamW/SGD (:class:`~lightning_amp.amp.kernel_step.KernelStep`).
A plan holds whatever the owner built from the param groups (its "parts": the lists one kernel call
updates) together with the groups' signature when it was built. It is reused while the signature
is unchanged: the number of groups and, for each group, the identity and length of its params list
and the identity of its first and last param, plus the owner's own per-group items (``key``, e.g.
whether AMSGrad state is kept). Building, and what makes a plan incomplete (a param without grad or
state), stay with the owner; ``drop()`` forgets the plan (``add_param_group``, ``load_state_dict``).

Under ``torch.compile`` nothing is cached: dynamo's guards on the param groups already decide when a
step is traced again, and a cache read inside the graph would only add a guard on it (a recompile
at the second step) or, on torch 2.11, a graph break (dynamo there cannot trace ``id()`` of a list).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch


class StepPlan:
    """A cached plan of kernel calls, valid while the param groups keep their signature.

    Args:
        key: optional ``group -> tuple`` of extra per-group items the plan depends on.
    """

    __slots__ = ("_key", "signature", "parts")

    def __init__(self, key: Optional[Callable[[dict], tuple]] = None) -> None:
        self._key = key
        self.signature: Optional[tuple] = None
        self.parts: Any = None

    def signature_of(self, param_groups: Sequence[dict]) -> tuple:
        """The groups' current signature (host-only: ids and lengths, no tensor is read)."""
        out = []
        for group in param_groups:
            ps = group["params"]
            item = (id(ps), len(ps), id(ps[0]) if ps else 0, id(ps[-1]) if ps else 0)
            out.append(item + self._key(group) if self._key is not None else item)
        return tuple(out)

    def current(self, param_groups: Sequence[dict]) -> bool:
        """Whether a plan is stored and was built for groups of this signature."""
        return self.signature is not None and self.signature == self.signature_of(param_groups)

    def cached(self, param_groups: Sequence[dict], need_grads: bool = True) -> Any:
        """The stored parts when :meth:`current` (and, with ``need_grads``, every param has a grad), else None."""
        if torch.compiler.is_compiling() or not self.current(param_groups):
            return None
        if need_grads and any(p.grad is None for group in param_groups for p in group["params"]):
            return None
        return self.parts

    def store(self, param_groups: Sequence[dict], parts: Any) -> None:
        """Keep ``parts`` as the plan for the groups as they are now (nothing while compiling)."""
        if torch.compiler.is_compiling():
            return
        self.signature = self.signature_of(param_groups)
        self.parts = parts

    def drop(self) -> None:
        """Forget the plan: the next step builds a new one."""
        self.signature = None
        self.parts = None

    @property
    def built(self) -> bool:
        return self.signature is not None
