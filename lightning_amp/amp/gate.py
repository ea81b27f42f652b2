"""StepGate: the host learns whether an optimizer step was skipped without a host sync, and LR
schedulers that do not advance on skipped steps.

Each optimizer step's ``found_inf`` (a device tensor), together with the step's per-tensor
non-finite flags when given, is copied non-blocking into a host buffer (pinned on CUDA) and an
event is recorded behind the copy; :meth:`StepGate.poll` reads those buffers only once their copy
has landed (``event.query()``, never a wait) unless asked to ``wait`` for them (an event wait on
that one step, not a device-wide synchronisation). Everything a skip triggers (``on_skip``) gets
the record of the step it belongs to (its ``context`` and its flags), however late it lands.

Skip-aware LR schedulers (:func:`make_scheduler_skip_aware`) decide from this flag:
``scheduler.step()`` right after optimizer step *t* takes effect iff step *t* was not skipped.
When the flag of step *t* is not on the host yet, the call is deferred and run (or dropped) as
soon as it is: the owner settles the gate (``settle_deferred()``) before the optimizer's next
step, whose kernels read the ``lr`` the scheduler writes, and ``state_dict()`` /
``get_last_lr()`` of a skip-aware scheduler settle it first. On CPU the copy is immediate, so
every decision is taken at once. A scheduler whose optimizer has no gate steps as usual.

A device that runs behind the host can be simulated (for tests, on any device): with
``LIGHTNING_AMP_SIMULATE_DEVICE_LAG=N`` in the environment, or inside ``simulate_device_lag(N)``,
gates created from then on treat a step's flag as landed only when it is waited for or once
``N`` further steps have been recorded (``N = 0``: as the device reports, the default).
"""
from __future__ import annotations

import contextlib
import os
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

#: optimizer -> its gate, both held weakly: the gate lives as long as the step that owns it (and its ``on_skip``, which
#: holds the optimizer), so nothing here keeps an optimizer, its params or the plugin alive after a run
_GATES: "weakref.WeakKeyDictionary[Any, weakref.ref[StepGate]]" = weakref.WeakKeyDictionary()

LAG_ENV = "LIGHTNING_AMP_SIMULATE_DEVICE_LAG"
_lag_override: Optional[int] = None


def _checked_lag(value: Any, name: str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        raise ValueError(f"{name} must be a non-negative integer number of steps, got {value!r}")
    return int(text)


def simulated_device_lag() -> int:
    """Steps a flag is held back for by gates created now (``simulate_device_lag`` or ``LAG_ENV``)."""
    if _lag_override is not None:
        return _lag_override
    return _checked_lag(os.environ.get(LAG_ENV, "0"), LAG_ENV)


@contextlib.contextmanager
def simulate_device_lag(steps: int) -> Iterator[None]:
    """Gates created inside see each flag only when waited for or ``steps`` recorded steps later."""
    global _lag_override
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"simulate_device_lag(steps) takes an int, got {type(steps).__name__}")
    previous, _lag_override = _lag_override, _checked_lag(steps, "simulate_device_lag(steps)")
    try:
        yield
    finally:
        _lag_override = previous


class _Record(NamedTuple):
    index: int
    host: Tensor
    view: Any  # numpy view of ``host``: [found_inf, per-tensor flags...]
    event: Optional[Any]
    context: Any


class StepGate:
    """Host copies of one optimizer's per-step ``found_inf`` flags (see the module docstring).

    Args:
        on_skip: called once per skipped step, when its flag reaches the host (in step order), with
            the ``context`` given to :meth:`record` for that step and its per-tensor flags on the
            host (a float array, non-zero where a tensor held inf/nan; None when none were recorded).
    """

    def __init__(self, on_skip: Callable[[Any, Optional[Any]], None]) -> None:
        self._on_skip = on_skip
        self._pending: Deque[_Record] = deque()
        self._pool: List[Tuple[Tensor, Any, Optional[Any]]] = []
        self._deferred: List[Tuple[int, Callable[[], Any]]] = []
        self._recorded = 0
        self._lag = simulated_device_lag()
        self.last_skipped = False  # of the newest settled step
        #: called for every settled step, in order, with (skipped, that step's host payload after
        #: ``found_inf``: what :meth:`record` got as ``flags``, or None); read it at once, its buffer is reused
        self.watchers: List[Callable[[bool, Optional[Any]], None]] = []

    @property
    def lands_at_once(self) -> bool:
        """Whether a flag recorded on ``device`` reaches the host inside :meth:`record` (a CPU flag
        without a simulated lag): whoever reacts to it can still read that step's tensors then."""
        return self._lag == 0

    def attach(self, optimizer: Any) -> None:
        """Make ``optimizer``'s skip-aware schedulers consult this gate, and its ``state_dict()`` settle
        the deferred scheduler calls first (they write the ``lr`` that state holds)."""
        if optimizer not in _GATES:
            optimizer.register_state_dict_pre_hook(_settle_before_state_dict)
        _GATES[optimizer] = weakref.ref(self)

    def record(self, found_inf: Tensor, flags: Optional[Tensor] = None, context: Any = None) -> None:
        """After a step: start the non-blocking copy of its ``found_inf`` (0-dim) and ``flags`` (1-dim,
        on the same device) to the host; ``context`` is handed back to ``on_skip``."""
        payload = found_inf.detach().reshape(1).float()
        if flags is not None:
            payload = torch.cat([payload, flags.detach().reshape(-1).to(payload)])
        host, view, event = self._buffer(payload.numel(), payload.device.type == "cuda")
        host.copy_(payload, non_blocking=True)
        if event is not None:
            event.record()
        self._recorded += 1
        self._pending.append(_Record(self._recorded, host, view, event, context))
        self.poll()

    def _buffer(self, numel: int, cuda: bool) -> Tuple[Tensor, Any, Optional[Any]]:
        for i, entry in enumerate(self._pool):
            if entry[0].numel() == numel:
                return self._pool.pop(i)
        host = torch.empty(numel, dtype=torch.float32, pin_memory=cuda)
        return host, host.numpy(), (torch.cuda.Event() if cuda else None)

    def _landed(self, record: _Record, wait: bool) -> bool:
        if self._lag and not wait and self._recorded - record.index < self._lag:
            return False
        if record.event is not None and not record.event.query():
            if not wait:
                return False
            record.event.synchronize()
        return True

    def poll(self, wait: bool = False) -> None:
        """Settle every step whose flag has reached the host (all of them with ``wait``), in order."""
        while self._pending:
            record = self._pending[0]
            if not self._landed(record, wait):
                return
            self._pending.popleft()
            self.last_skipped = bool(record.view[0] != 0)
            payload = record.view[1:] if len(record.view) > 1 else None
            if self.last_skipped:
                self._on_skip(record.context, payload)
            for watch in self.watchers:
                watch(self.last_skipped, payload)
            self._pool.append((record.host, record.view, record.event))
            due = [fn for i, fn in self._deferred if i == record.index]
            self._deferred = [(i, fn) for i, fn in self._deferred if i != record.index]
            if not self.last_skipped:
                for fn in due:
                    fn()

    def settle_deferred(self) -> None:
        """Before the next optimizer step: wait for the flags that deferred scheduler calls depend on
        (their ``lr`` must be written before the step's kernels read it); without any, only poll, so
        the host keeps running ahead of the device."""
        self.poll(wait=bool(self._deferred))

    def last_step_skipped(self) -> Optional[bool]:
        """Whether the newest recorded step was skipped; None while its flag is still on the way."""
        self.poll()
        return None if self._pending else self.last_skipped

    def defer(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once the newest recorded step is settled, unless that step was skipped."""
        self._deferred.append((self._recorded, fn))


def gate_of(optimizer: Any) -> Optional[StepGate]:
    """The gate of ``optimizer``'s step (of the optimizer a Lightning wrapper holds), None when none is alive."""
    ref = _GATES.get(getattr(optimizer, "_optimizer", optimizer))
    return None if ref is None else ref()


def _settle_before_state_dict(optimizer: Any) -> None:
    gate = gate_of(optimizer)
    if gate is not None:
        gate.settle_deferred()


_SKIP_AWARE: Dict[type, type] = {}


def _skip_aware_class(cls: type) -> type:
    if getattr(cls, "_lightning_amp_skip_aware", False):
        return cls
    if cls not in _SKIP_AWARE:

        def step(self, *args: Any, **kwargs: Any) -> Any:
            gate = gate_of(getattr(self, "optimizer", None))
            if gate is None:
                return cls.step(self, *args, **kwargs)
            skipped = gate.last_step_skipped()
            if skipped is None:
                gate.defer(lambda: cls.step(self, *args, **kwargs))
                return None
            return None if skipped else cls.step(self, *args, **kwargs)

        def settled(method: Callable) -> Callable:
            def wrapper(self, *args: Any, **kwargs: Any) -> Any:
                gate = gate_of(getattr(self, "optimizer", None))
                if gate is not None:
                    gate.poll(wait=True)
                return method(self, *args, **kwargs)

            return wrapper

        def __reduce_ex__(self, protocol: Any) -> Any:
            # the wrapper class cannot be looked up by name: rebuild it from the original class
            return _rebuild_skip_aware, (cls, self.__dict__.copy())

        _SKIP_AWARE[cls] = type(
            cls.__name__,
            (cls,),
            {"step": step, "state_dict": settled(cls.state_dict), "get_last_lr": settled(cls.get_last_lr),
             "__reduce_ex__": __reduce_ex__, "_lightning_amp_skip_aware": True,
             "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _SKIP_AWARE[cls]


def _rebuild_skip_aware(cls: type, state: Dict[str, Any]) -> Any:
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    make_scheduler_skip_aware(scheduler)
    return scheduler


def make_scheduler_skip_aware(scheduler: Any) -> None:
    """Make ``scheduler.step()`` a no-op right after a skipped step of ``scheduler.optimizer``
    (decided through the optimizer's :class:`StepGate`, see the module docstring).

    The scheduler's class is swapped for a subclass (``isinstance`` and ``state_dict`` unchanged).
    """
    scheduler.__class__ = _skip_aware_class(type(scheduler))
