"""Apex O1 cast-list control on top of ``torch.autocast``.

``register_half_function(module, name)`` (and the float / promote variants) records that
``module.name`` must run under a cast policy. Nothing is patched at registration time:
``cast_context(dtype, device_type)`` replaces the registered attributes with policy wrappers
when the first context in the process opens and puts the original objects back (exactly:
an attribute that was inherited is deleted again) when the last one closes, also on error.
Registrations made while a context is open take effect from the next first opening.

Policies, applied to floating tensors found in the arguments (also inside lists, tuples and
dicts), after which the function runs with autocast *disabled* so the cast sticks:

* half: cast to the context's ``dtype``;
* float: cast lower-precision floats (fp16, bf16, ...) up to float32 (float64 is left alone);
* promote: cast to the widest floating dtype among the arguments (torch.promote_types).

The wrappers look up the *calling thread's* innermost open context, so a thread that has
none sees the plain function even while another thread holds the attributes patched.
``cast_context`` does not enter ``torch.autocast`` itself; the caller nests the two.

The decorators ``half_function`` / ``float_function`` / ``promote_function`` wrap a user
function with the same policy, active only inside a ``cast_context``.

fp16 BCE refusal: inside a float16 context ``torch.nn.functional.binary_cross_entropy`` (and
so ``nn.BCELoss``, which looks it up at call time) raises ``UnsafeHalfOpError``, as apex
did; bf16 contexts and code outside any context are unaffected. Registering the function
explicitly (e.g. ``register_float_function(torch.nn.functional, "binary_cross_entropy")``)
replaces the refusal with that policy, like apex's ``allow_banned``.

RNNs without a half kernel: inside a CPU context whose dtype oneDNN has no RNN kernel for, the
fused RNN functions that ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` call (``torch._VF.lstm``, ``gru``,
``rnn_tanh``, ``rnn_relu``) run in float32 (autocast off), where autocast would send them to
oneDNN and fail ("could not create a primitive descriptor"): float16 always; bfloat16 on CPUs
without oneDNN's bf16 RNN (no AVX-512 BF16 / AMX, e.g. AVX2-only machines; probed once per
process with a one-element LSTM). Elsewhere (bf16 on a capable CPU, CUDA) autocast handles them
as usual. An explicit registration of one of these functions replaces this default.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from lightning_amp.amp.process_state import ProcessChange

HALF, FLOAT, PROMOTE = "half", "float", "promote"
_REFUSE_FP16 = "refuse_fp16"
_FLOAT_IF_CPU_FP16 = "float_if_cpu_fp16"
_RNN_FUNCTIONS = ("lstm", "gru", "rnn_tanh", "rnn_relu")  # in torch._VF; the cells are plain matmuls

_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy / torch.nn.BCELoss are unsafe in float16 mixed precision: "
    "log(p) and log(1 - p) of half-precision probabilities lose the values near 0 and 1. "
    "Use torch.nn.BCEWithLogitsLoss or "
    "torch.nn.functional.binary_cross_entropy_with_logits on the logits instead (they fuse the sigmoid and "
    "run safely), or, if you really need it, register_float_function(torch.nn.functional, "
    '"binary_cross_entropy") to run it in float32.'
)


class UnsafeHalfOpError(RuntimeError):
    """Raised when a function known to be unsafe in float16 is called inside a float16 cast_context."""


_MISSING = object()
_lock = threading.RLock()
_registry: Dict[Tuple[int, str], Tuple[Any, str, str]] = {}
_local = threading.local()


def _context_stack() -> List[Tuple[torch.dtype, str]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def active_cast() -> Optional[Tuple[torch.dtype, str]]:
    """(dtype, device_type) of the calling thread's innermost open cast_context, or None."""
    stack = _context_stack()
    return stack[-1] if stack else None


# ----------------------------------------------------------------------------- casting


def _cast_tree(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return cast(value) if value.is_floating_point() else value
    if isinstance(value, list):
        return [_cast_tree(v, cast) for v in value]
    if isinstance(value, tuple):
        items = [_cast_tree(v, cast) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _cast_tree(v, cast) for k, v in value.items()}
    return value


def _floating_dtypes(value: Any, found: List[torch.dtype]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.append(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _floating_dtypes(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _floating_dtypes(v, found)


def _target_cast(policy: str, dtype: torch.dtype, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], Any]:
    if policy == HALF:
        return lambda t: t.to(dtype)
    if policy == FLOAT:
        return lambda t: t.float() if torch.finfo(t.dtype).bits < 32 else t
    found: List[torch.dtype] = []
    _floating_dtypes((args, kwargs), found)
    widest = functools.reduce(torch.promote_types, found) if found else None
    return lambda t: t.to(widest)


@functools.lru_cache(maxsize=None)
def cpu_has_bf16_rnn() -> bool:
    """Whether this CPU runs a bfloat16 LSTM under autocast (oneDNN needs AVX-512 BF16 or AMX):
    probed once with a one-element LSTM, through the unpatched function."""
    weights = [torch.ones(4, 1), torch.ones(4, 1), torch.ones(4), torch.ones(4)]
    state = (torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            torch._C._VariableFunctions.lstm(torch.ones(1, 1, 1), state, weights, True, 1, 0.0, False, False, False)
    except RuntimeError:
        return False
    return True


def _run_with_policy(fn: Callable, policy: str, args: tuple, kwargs: dict) -> Any:
    active = active_cast()
    if active is None:
        return fn(*args, **kwargs)
    dtype, device_type = active
    if policy == _REFUSE_FP16:
        if dtype == torch.float16:
            raise UnsafeHalfOpError(_BCE_MESSAGE)
        return fn(*args, **kwargs)
    if policy == _FLOAT_IF_CPU_FP16:
        if device_type != "cpu" or (dtype == torch.bfloat16 and cpu_has_bf16_rnn()):
            return fn(*args, **kwargs)
        policy = FLOAT
    cast = _target_cast(policy, dtype, args, kwargs)
    args, kwargs = _cast_tree(args, cast), _cast_tree(kwargs, cast)
    with torch.autocast(device_type=device_type, enabled=False):
        return fn(*args, **kwargs)


def _policy_wrapper(fn: Callable, policy: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _run_with_policy(fn, policy, args, kwargs)

    wrapper.__lightning_amp_policy__ = policy  # type: ignore[attr-defined]
    return wrapper


# ----------------------------------------------------------------------------- registration


def _register(module: Any, name: str, policy: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be the name (a non-empty str) of a function in `module`; got {name!r}")
    if not hasattr(module, name):
        raise ValueError(f"`name`: no attribute {name!r} in `module` {module!r}")
    if not callable(getattr(module, name)):
        raise ValueError(f"`name`: {module!r}.{name} is not callable, so it cannot get a cast policy")
    with _lock:
        _registry[(id(module), name)] = (module, name, policy)


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the cast_context's half dtype (autocast off) while a context is open."""
    _register(module, name, HALF)


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` in float32 (autocast off) while a cast_context is open."""
    _register(module, name, FLOAT)


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in its arguments' widest floating dtype (autocast off) while a context is open."""
    _register(module, name, PROMOTE)


def unregister_function(module: Any, name: str) -> None:
    """Forget a registration (effective from the next first opening of a cast_context)."""
    with _lock:
        _registry.pop((id(module), name), None)


def registered_functions() -> List[Tuple[Any, str, str]]:
    """A snapshot of the registrations as (module, name, policy)."""
    with _lock:
        return list(_registry.values())


def _decorator(fn: Callable, policy: str) -> Callable:
    if not callable(fn):
        raise TypeError(f"`fn` must be callable to get the {policy!r} cast policy; got {fn!r}")
    return _policy_wrapper(fn, policy)


def half_function(fn: Callable) -> Callable:
    """Decorator: inside a cast_context, cast floating args to its dtype and run with autocast off."""
    return _decorator(fn, HALF)


def float_function(fn: Callable) -> Callable:
    """Decorator: inside a cast_context, cast half args to float32 and run with autocast off."""
    return _decorator(fn, FLOAT)


def promote_function(fn: Callable) -> Callable:
    """Decorator: inside a cast_context, cast floating args to the widest among them, autocast off."""
    return _decorator(fn, PROMOTE)


# ----------------------------------------------------------------------------- patching


def _patch_targets() -> List[Tuple[Any, str, str]]:
    targets = list(_registry.values())
    defaults = [(F, "binary_cross_entropy", _REFUSE_FP16)]
    defaults += [(torch._VF, name, _FLOAT_IF_CPU_FP16) for name in _RNN_FUNCTIONS]
    targets += [(module, name, policy) for module, name, policy in defaults if (id(module), name) not in _registry]
    return targets


def _wrap_attribute(module: Any, name: str, policy: str, raw: Any) -> Any:
    if isinstance(raw, staticmethod):
        return staticmethod(_policy_wrapper(raw.__func__, policy))
    if isinstance(raw, classmethod):
        return classmethod(_policy_wrapper(raw.__func__, policy))
    return _policy_wrapper(getattr(module, name), policy)


def _restore(saved: List[Tuple[Any, str, Any]]) -> None:
    while saved:
        module, name, raw = saved.pop()
        if raw is _MISSING:
            delattr(module, name)
        else:
            setattr(module, name, raw)


def _patch_all() -> List[Tuple[Any, str, Any]]:
    """Wrap every registered function (and the default rules) in its policy; what was there before, to restore."""
    saved: List[Tuple[Any, str, Any]] = []
    with _lock:
        try:
            for module, name, policy in _patch_targets():
                raw = vars(module).get(name, _MISSING) if hasattr(module, "__dict__") else _MISSING
                wrapper = _wrap_attribute(module, name, policy, raw)
                setattr(module, name, wrapper)
                saved.append((module, name, raw))
        except BaseException:
            _restore(saved)
            raise
    return saved


_PATCHES = ProcessChange("torch functions patched by the cast lists", _patch_all, _restore)


def patch_depth() -> int:
    """How many cast_contexts are open in the process (all threads); 0 means nothing is patched."""
    return _PATCHES.holders


@contextlib.contextmanager
def cast_context(dtype: torch.dtype, device_type: str = "cpu") -> Iterator[None]:
    """Activate the registered cast policies and the fp16 BCE refusal for the calling thread.

    ``dtype``: the half dtype of the run (a floating torch.dtype); ``device_type``: the
    autocast device type ("cpu", "cuda", ...) whose autocast the policies switch off.
    Nested and concurrent contexts are safe; everything is restored when the last closes.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"`dtype` must be a floating torch.dtype such as torch.float16 or torch.bfloat16; got {dtype!r}"
        )
    if not isinstance(device_type, str) or not device_type:
        raise ValueError(f'`device_type` must be a device type string such as "cpu" or "cuda"; got {device_type!r}')
    _PATCHES.acquire()
    stack = _context_stack()
    stack.append((dtype, device_type))
    try:
        yield
    finally:
        stack.pop()
        _PATCHES.release()
