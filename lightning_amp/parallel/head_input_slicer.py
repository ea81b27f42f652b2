"""Per-head inputs of an attention cut to this rank's heads on every call: a forward pre-hook installed by the
conversion (:func:`~lightning_amp.parallel.convert.convert`) for the inputs the reading found
(:mod:`~lightning_amp.parallel.reading.head_inputs`: an ALiBi bias built for all heads outside the attention, BLOOM's
``alibi``, MPT's ``position_bias``).

Along the input's third-to-last dimension (broadcasting aligns it with the scores from the last one): the heads alone
are narrowed to this rank's; the batch and the heads folded batch first are unfolded, narrowed and folded back; a
size-1 dimension (a mask shared by all heads) is left as it is, and any other size than the heads' is an error that
names the input.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from lightning_amp.parallel.groups import group_rank, group_size
from lightning_amp.parallel.reading.families import Unit
from lightning_amp.parallel.reading.head_inputs import HeadInput


class HeadInputSlicer:
    """A forward pre-hook (``with_kwargs=True``) that cuts the :class:`HeadInput` s of an attention of ``n_head``
    query heads to heads ``[first, first + local)`` of this rank."""

    def __init__(self, module: nn.Module, inputs: tuple[HeadInput, ...], n_head: int, rank: int, tp: int) -> None:
        self.inputs, self.n_head = inputs, n_head
        self.local = n_head // tp
        self.first = rank * self.local
        self.where = type(module).__name__
        forward = inspect.signature(inspect.unwrap(type(module).forward))
        self.positional = [p.name for p in list(forward.parameters.values())[1:]
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for spec in self.inputs:
            if spec.name in kwargs:
                kwargs[spec.name] = self.cut(spec, kwargs[spec.name])
            elif spec.name in self.positional[:len(args)]:
                position = self.positional.index(spec.name)
                args[position] = self.cut(spec, args[position])
        return tuple(args), kwargs

    def cut(self, spec: HeadInput, value: Any) -> Any:
        """``value`` cut to this rank's heads along its third-to-last dimension (see the module docstring)."""
        if not isinstance(value, Tensor) or value.dim() < 3 or value.shape[-3] == 1:
            return value
        size = value.shape[-3]
        if not spec.folded and size == self.n_head:
            return value.narrow(-3, self.first, self.local)
        if spec.folded and size % self.n_head == 0:
            heads = value.unflatten(-3, (size // self.n_head, self.n_head))
            return heads.narrow(-3, self.first, self.local).flatten(-4, -3)
        raise RuntimeError(f"tp_fused: {self.where} gets {spec.name} of shape {tuple(value.shape)}, whose dimension -3 "
                           f"holds {size}: not its {self.n_head} heads" + (" times the batch" if spec.folded else "")
                           + ", so this rank cannot take its heads from it")


def install_head_inputs(module: nn.Module, unit: Unit, group: Any) -> str:
    """Register a :class:`HeadInputSlicer` on every attention of ``unit`` (a plan unit) that has per-head inputs;
    returns what the plan report adds to the unit's heads line ("" when none)."""
    names = []
    for owner_path, inputs in unit.head_inputs.items():
        owner = module.get_submodule(owner_path) if owner_path else module
        slicer = HeadInputSlicer(owner, inputs, unit.attention_shape.n_head, group_rank(group), group_size(group))
        owner.register_forward_pre_hook(slicer, with_kwargs=True)
        names += [spec.name for spec in inputs]
    return f"; input(s) {', '.join(dict.fromkeys(names))} cut to each rank's heads where they hold them" if names else ""
