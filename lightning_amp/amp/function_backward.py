"""Custom ``torch.autograd.Function``\\ s called inside O2's forward: their backward runs under that forward's autocast.

O2's op policy casts an fp32 Parameter to half where it meets a half tensor in an elementwise op
(:mod:`~lightning_amp.amp.o2.policy`). A user's Function whose forward computes ``x @ w.t() + b`` from a
module's Parameters therefore returns half where ``bf16-mixed`` returns fp32 (its ``+ b`` promotes), and
its backward gets a half gradient ``g`` that meets the fp32 ``w`` it saved: ``g @ w`` raises torch's dtype
error outside autocast. ``torch.amp.custom_bwd`` is torch's answer for such Functions: their backward runs
under the autocast state of their forward, where ``g @ w`` is a half matmul. Inside O2's forward
(:func:`autocast_backward`) every Function applied on a thread where O2's rules are active gets that
treatment, decorated or not: its backward node runs the Function's ``backward`` under the forward's
autocast (CPU and CUDA, dtype as in the forward, weight cache off). Nothing changes in forward, so O2's
half stream is kept; ``bf16-mixed`` and every thread outside O2's forward are untouched.

torch's own Functions (``torch.*``: checkpointing, compiled graphs) and lightning_amp's (tensor-parallel
layers, written for O2's dtypes) are left alone, as is any ``apply`` a class defines itself.

How, and what it leans on (docs/architecture.md, "torch and Lightning internals"):

* finding the Functions: ``torch.autograd.Function.apply`` is replaced by a classmethod that calls torch's
  own through the descriptor protocol (``vars(Function)["apply"].__get__(None, cls)``), whatever type torch
  implements it with (a Python ``classmethod`` up to 2.13, a C ``classmethod_descriptor`` from 2.14), while
  at least one :func:`autocast_backward` is open in the process (reference counted across threads), and put
  back, the same object, when the last closes. torch has no public hook for "a Function was applied";
* running the backward under autocast: public ``torch.autograd.graph.Node`` hooks on the Function's node
  (a pre-hook sets the forward's autocast state with ``torch.set_autocast_enabled``/``_dtype``/``_cache_enabled``,
  a post-hook puts the thread's previous one back: what ``torch.autocast`` blocks do, without their Python
  objects). If the backward raises, the post-hook does not run; the autograd engine restores each node's
  thread-local state (autocast included) after it runs, and ``tests/amp/test_function_backward.py`` checks that
  it does.
"""
from __future__ import annotations

import contextlib
from typing import Any, List, Tuple

import torch
from torch.autograd.function import BackwardCFunction

from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.process_state import ProcessChange

_LEFT_ALONE = ("torch.", "lightning_amp.")
_AUTOCAST_DEVICES = ("cpu", "cuda")
_torchs_apply: Any = None  # torch's own ``vars(Function)["apply"]`` (a descriptor) while replaced

AutocastState = List[Tuple[str, torch.dtype]]


def _forward_autocast() -> AutocastState:
    return [(device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)]


def _run_backward_under(node: BackwardCFunction, state: AutocastState) -> None:
    """``node``'s backward runs under the autocast ``state`` (weight cache off), as ``torch.autocast`` blocks would
    run it; the hooks hold the state, not the node. The thread's previous autocast settings are put back after."""
    saved: List[Tuple[List[Tuple[str, bool, torch.dtype]], bool]] = []

    def enter(grad_outputs: Any) -> None:
        saved.append(([(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                       for device, _ in state], torch.is_autocast_cache_enabled()))
        for device, dtype in state:
            torch.set_autocast_dtype(device, dtype)
            torch.set_autocast_enabled(device, True)
        torch.set_autocast_cache_enabled(False)

    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        devices, cache = saved.pop()
        for device, enabled, dtype in devices:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(cache)

    node.register_prehook(enter)
    node.register_hook(leave)


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    outputs = _torchs_apply.__get__(None, cls)(*args, **kwargs)
    if not o2_policy.active() or (cls.__module__ or "").startswith(_LEFT_ALONE) or "apply" in vars(cls):
        return outputs
    state = _forward_autocast()
    if state:
        seen = set()
        for output in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            node = output.grad_fn if isinstance(output, torch.Tensor) else None
            if isinstance(node, BackwardCFunction) and id(node) not in seen:
                seen.add(id(node))
                _run_backward_under(node, state)
    return outputs


def _replace_apply() -> Any:
    global _torchs_apply
    _torchs_apply = vars(torch.autograd.Function)["apply"]
    torch.autograd.Function.apply = classmethod(_apply)
    return _torchs_apply


def _put_back(torchs_apply: Any) -> None:
    torch.autograd.Function.apply = torchs_apply  # kept in _torchs_apply too: a call may be on its way


_APPLY = ProcessChange("torch.autograd.Function.apply", _replace_apply, _put_back)


def autocast_backward() -> contextlib.AbstractContextManager:
    """Inside the block, the backward of a user's Function applied where O2's rules are active runs under
    the autocast state of its forward (see the module docstring). Nestable, from any thread."""
    return _APPLY.held()


def depth() -> int:
    """How many :func:`autocast_backward` blocks are open in the process (0: ``Function.apply`` is torch's)."""
    return _APPLY.holders
