"""O2's op policy: under autocast, norms, softmax and activations stay in the half dtype.

O2 forwards under ``torch.autocast(dtype)`` with the module's fp32 Parameters, so every op reconciles
dtypes as under Lightning's ``bf16-mixed`` (``module.weight`` is always the Parameter). Autocast alone
would also upcast what torch lists as fp32-sensitive (on CUDA: ``layer_norm``, ``group_norm``,
``rms_norm``, ``softmax``, ``log_softmax``, ``pow``, ``exp``, ``sum``, upsampling, ...) and leave a
model's embeddings and its Parameters read outside a matmul (an RMSNorm weight, a layer scale, a
learned position table) fp32, so the residual stream would run fp32. The compiled kernels of
``csrc/o2_policy.cpp``, registered over torch's autocast kernels, apply O2's rules instead while O2's
forward is entered on the calling thread (:func:`forward`): norms run in their input's dtype with
half copies of their weights, the fp32-list math runs on its inputs as they come, embeddings are cast to
half, an fp32 tensor that is no activation of the stream (a Parameter, any view or expression of
Parameters, a buffer, a mask, a statistic that broadcasts into the stream) meeting a half activation
gives a half result (the half stream by construction, docs/o2-design.md), and losses stay fp32. On every other thread,
and on this one outside O2's forward, each kernel is exactly torch's own (the table and the comparison
are in ``tests/amp/test_o2_policy.py``).

Lifetime: :func:`hold` registers the kernels (reference counted across holders) and returns a
:class:`PolicyHold` whose :meth:`~PolicyHold.release` removes them once the last holder releases, so
after a run torch's autocast is exactly as before. The Trainer plugin holds it from ``convert_module``
to ``teardown``; the Fabric plugin (Fabric has no end of run) around each forward context
(:func:`held`: about 0.07 ms to register, as much to remove, on the CPU that measured it) and a
recomputing backward. Host cost otherwise: one C++ check per registered op under autocast; entering and
leaving :func:`forward` is two calls per forward.

``LIGHTNING_AMP_O2_POLICY_MODE=cuda-lists-on-cpu`` (read at each :func:`hold`) registers CUDA's
autocast lists on the CPU key too, so a whole CPU run (O2 beside ``bf16-mixed``) sees what a GPU's
autocast would upcast: the tests' stand-in for a GPU, as ``LIGHTNING_AMP_SIMULATE_DEVICE_LAG`` is for
a device running behind the host.

Without the compiled extension there is no policy: O2's forward is then ``bf16-mixed``'s (norms and
softmax upcast on CUDA), with a RuntimeWarning at the first :func:`hold`.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Iterator, List, Optional, Tuple

from lightning_amp import ops
from lightning_amp.amp.process_state import CountedElsewhere

_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel.*"
_MODES = ("torch", "cuda-lists-on-cpu")
MODE_ENV = "LIGHTNING_AMP_O2_POLICY_MODE"
_lock = threading.Lock()
_warned_missing = False


def available() -> bool:
    """Whether the compiled policy can be installed (the extension is loaded)."""
    return ops.extension_module() is not None


class PolicyHold:
    """One holder's registration of the policy's kernels (see :func:`hold`)."""

    def __init__(self, ext) -> None:
        self._ext = ext

    @property
    def held(self) -> bool:
        """Whether this hold still keeps the kernels registered."""
        return self._ext is not None

    def release(self) -> None:
        """Give the registration back (idempotent); the last one removes the kernels."""
        with _lock:
            ext, self._ext = self._ext, None
        if ext is not None:
            ext.o2_uninstall()


def hold(mode: Optional[str] = None) -> PolicyHold:
    """Register the policy's kernels on the AutocastCPU and AutocastCUDA keys until the returned hold
    is released. ``mode``: "torch" (production: each key keeps torch's own lists where the policy is
    not active) or "cuda-lists-on-cpu" (tests: the CPU key runs CUDA's autocast lists, so the CPU
    exercises the policy CUDA needs); None reads ``LIGHTNING_AMP_O2_POLICY_MODE`` (default "torch").
    Without the extension: a hold that holds nothing (warned once)."""
    if mode is None:
        mode = os.environ.get(MODE_ENV, "torch")
        if mode not in _MODES:
            raise ValueError(f"{MODE_ENV} must be one of {_MODES}; got {mode!r}")
    if mode not in _MODES:
        raise ValueError(f"o2_policy.hold: `mode` must be one of {_MODES}; got {mode!r}")
    ext = ops.extension_module()
    if ext is None:
        _warn_missing()
        return PolicyHold(None)
    with warnings.catch_warnings():  # torch warns once per process when a kernel is registered over its own
        warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING, category=UserWarning)
        ext.o2_install(mode)
    return PolicyHold(ext)


@contextlib.contextmanager
def held(mode: Optional[str] = None) -> Iterator[None]:
    """The kernels registered for the duration of the block (:func:`hold` and its release)."""
    policy = hold(mode)
    try:
        yield
    finally:
        policy.release()


def installs() -> int:
    """How many holds keep the kernels registered now (0: torch's autocast is untouched)."""
    ext = ops.extension_module()
    return 0 if ext is None else int(ext.o2_installs())


CountedElsewhere("O2's op policy: kernels registered on autocast's dispatch keys", installs)  # counted by the extension


@contextlib.contextmanager
def forward() -> Iterator[None]:
    """O2's forward on the calling thread: inside, the registered kernels apply O2's rules (nestable)."""
    ext = ops.extension_module()
    if ext is None:
        yield
        return
    ext.o2_enter_forward()
    try:
        yield
    finally:
        ext.o2_exit_forward()


def active() -> bool:
    """Whether O2's rules apply on the calling thread now."""
    ext = ops.extension_module()
    return ext is not None and bool(ext.o2_active())


class SharedForward:
    """O2's forward for the forwards activation checkpointing re-runs inside a backward
    (:mod:`~lightning_amp.amp.recompute`), which may run on another thread (CUDA's autograd thread):
    :meth:`enter` holds the kernels, opens a region and joins the calling thread, :meth:`join` joins
    another thread, :meth:`exit` (from any thread) ends the region for every thread that joined."""

    def __init__(self) -> None:
        self._ext = ops.extension_module()
        self._token: Optional[int] = None
        self._hold: Optional[PolicyHold] = None

    def enter(self) -> None:
        if self._ext is not None:
            self._hold = hold()
            self._token = self._ext.o2_share_begin()
            self._ext.o2_share_join(self._token)

    def join(self) -> None:
        if self._token is not None:
            self._ext.o2_share_join(self._token)

    def exit(self) -> None:
        if self._token is not None:
            self._token = None
            self._ext.o2_share_end()
            self._hold.release()


def table() -> List[Tuple[str, str, str, bool, str]]:
    """(op, O2's rule, torch's policy for it on AutocastCUDA, registered on AutocastCPU, torch's policy for it on
    AutocastCPU) of every kernel; empty without the extension."""
    ext = ops.extension_module()
    return [] if ext is None else [tuple(row) for row in ext.o2_table()]


def _warn_missing() -> None:
    global _warned_missing
    if not _warned_missing:
        _warned_missing = True
        warnings.warn(
            f"lightning_amp: O2's half norm policy needs the compiled extension ({ops.extension_error()}); "
            "O2's forward runs under plain autocast, as bf16-mixed (norms and softmax upcast on CUDA).",
            RuntimeWarning,
            stacklevel=3,
        )
