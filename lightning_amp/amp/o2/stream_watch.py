"""O2's stream forensics: one warning the first time an O2 forward lets an fp32 activation promote the half
stream to fp32.

O2's op policy keeps the residual stream half by construction (docs/o2-design.md, "The half stream"): an fp32
Parameter, any view or expression of Parameters, a buffer, a mask or a per-row statistic meeting a half
activation gives a half result. What it leaves to torch's promotion is an fp32 *activation* of the result's
full size (an explicit upcast in the model's code, an fp32 residual, the output of an op with no half kernel
that the code ran in fp32): from there the stream, and every block after it, runs fp32 as under
``bf16-mixed``. The compiled kernels report that promotion once per arming (``o2_report_promotions``);
:func:`arm` turns the report into an :class:`Fp32StreamWarning` naming the op, its operands, the module whose
code ran it (its path in the prepared model) and the line, and the ways out. Losses are not among the ops
reported (torch's loss functions stay fp32 and are not registered).

One watch per process (the latest :func:`arm`); the plugins arm it in ``prepare`` when
``warn_on_fp32_stream`` is True (the default) and disarm it in ``release``. Host cost: none until a
promotion happens (one relaxed atomic load in the kernel that sees it), then one Python call.
"""
from __future__ import annotations

import inspect
import os
import warnings
import weakref
from typing import Optional

from torch import nn

from lightning_amp import ops

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.dirname(package.__file__)) + os.sep for package in (nn, ops))  # torch/, lightning_amp/


class Fp32StreamWarning(UserWarning):
    """O2's half stream was promoted to fp32 by an fp32 activation (see :mod:`lightning_amp.amp.o2.stream_watch`)."""


def arm(module: nn.Module) -> bool:
    """Warn (once) the next time an O2 forward promotes the half stream, naming modules by their path in
    ``module``. Returns whether the watch is armed (False without the compiled extension)."""
    ext = ops.extension_module()
    if ext is None:
        return False
    root = weakref.ref(module)
    ext.o2_report_promotions(lambda op, operands: _warn(root(), op, operands))
    return True


def disarm() -> None:
    """No more warnings (idempotent)."""
    ext = ops.extension_module()
    if ext is not None:
        ext.o2_report_promotions(None)


def _warn(root: Optional[nn.Module], op: str, operands: str) -> None:
    owner, line = _module_and_line(inspect.currentframe().f_back)
    where = _module_path(root, owner)
    at = f" at {line[0]}:{line[1]}" if line else ""
    warnings.warn_explicit(
        f"O2's half stream was promoted to fp32 by {op}({operands}) in {where}{at}: an fp32 activation of the "
        "result's full size met a half one, so from there on the stream, and every block after it, runs in fp32 "
        "as under bf16-mixed (its speed and memory, not bf16-true's). O2 keeps the stream half where the fp32 "
        "operand is a Parameter, a view or expression of Parameters, a buffer, a mask or a statistic that "
        "broadcasts into the stream (docs/o2-design.md); this one is none of them. Ways out: cast it where your "
        "code makes it fp32 (`.to(x.dtype)` after the fp32 computation), or register the function that makes it "
        "(`lightning_amp.register_half_function(module, name)`) so that it returns half. "
        "`warn_on_fp32_stream=False` silences this warning.",
        Fp32StreamWarning, line[0] if line else "<o2>", line[1] if line else 0, module="lightning_amp.o2")


def _module_and_line(frame):
    """The innermost ``nn.Module`` whose method is on the stack, and the first (file, line) outside torch and
    lightning_amp: the user's line that ran the op."""
    owner, line = None, None
    while frame is not None and (owner is None or line is None):
        code = frame.f_code
        if line is None and not code.co_filename.startswith(_LIBRARY_DIRS):
            line = (code.co_filename, frame.f_lineno)
        candidate = frame.f_locals.get("self")
        if owner is None and isinstance(candidate, nn.Module):
            owner = candidate
        frame = frame.f_back
    return owner, line


def _module_path(root: Optional[nn.Module], owner: Optional[nn.Module]) -> str:
    if owner is None:
        return "code outside any module"
    if root is not None:
        for name, module in root.named_modules():
            if module is owner:
                return f"module '{name or '<root>'}' ({type(owner).__name__})"
    return f"a {type(owner).__name__} module"
