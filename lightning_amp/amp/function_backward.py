"""Custom ``torch.autograd.Function``\\ s called inside O2's forward: their backward runs under that forward's autocast.

O2's op policy casts an fp32 Parameter to half where it meets a half tensor in an elementwise op
(:mod:`~lightning_amp.amp.o2_policy`). A user's Function whose forward computes ``x @ w.t() + b`` from a
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

Lifetime: ``torch.autograd.Function.apply`` is replaced while at least one :func:`autocast_backward` is
open in the process (reference counted across threads) and put back when the last closes; a marked node
holds the autocast state (no reference to itself) until autograd frees it.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, List, Tuple

import torch

from lightning_amp.amp import o2_policy

_LEFT_ALONE = ("torch.", "lightning_amp.")
_AUTOCAST_DEVICES = ("cpu", "cuda")
_lock = threading.Lock()
_depth = 0
_saved_apply: Any = None  # torch's own ``Function.apply`` (a classmethod) while replaced


def _forward_autocast() -> List[Tuple[str, torch.dtype]]:
    return [(device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)]


def _backward_under(node: Any, state: List[Tuple[str, torch.dtype]]) -> None:
    """Make the engine run ``node``'s backward under ``state`` (an instance ``apply``, which the engine calls;
    the node is reached through a weak reference, so it is freed as before)."""
    node_ref, backward = weakref.ref(node), type(node).apply

    def apply(*grads: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for device, dtype in state:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
            return backward(node_ref(), *grads)

    node.apply = apply


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    outputs = _saved_apply.__func__(cls, *args, **kwargs)
    if not o2_policy.active() or (cls.__module__ or "").startswith(_LEFT_ALONE) or "apply" in vars(cls):
        return outputs
    state = _forward_autocast()
    if state:
        for output in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            node = output.grad_fn if isinstance(output, torch.Tensor) else None
            if isinstance(node, cls._backward_cls) and "apply" not in vars(node):
                _backward_under(node, state)
    return outputs


@contextlib.contextmanager
def autocast_backward() -> Iterator[None]:
    """Inside the block, the backward of a user's Function applied where O2's rules are active runs under
    the autocast state of its forward (see the module docstring). Nestable, from any thread."""
    global _depth, _saved_apply
    with _lock:
        if _depth == 0:
            _saved_apply = vars(torch.autograd.Function)["apply"]
            torch.autograd.Function.apply = classmethod(_apply)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.autograd.Function.apply = _saved_apply


def depth() -> int:
    """How many :func:`autocast_backward` blocks are open in the process (0: ``Function.apply`` is torch's)."""
    with _lock:
        return _depth
