"""StepGate: the host learns whether an optimizer step was skipped without a host sync, and LR
schedulers that do not advance on skipped steps.

Each optimizer step's ``found_inf`` (a device tensor) is copied non-blocking into a host buffer
(pinned on CUDA) and an event is recorded behind the copy; :meth:`StepGate.poll` reads those
buffers only once their copy has landed (``event.query()``, never a wait) unless asked to
``wait`` for them (an event wait on that one step, not a device-wide synchronisation).

Skip-aware LR schedulers (:func:`make_scheduler_skip_aware`) decide from this flag:
``scheduler.step()`` right after optimizer step *t* takes effect iff step *t* was not skipped.
When the flag of step *t* is not on the host yet, the call is deferred and run (or dropped) as
soon as it is: the owner settles the gate (``settle_deferred()``) before the optimizer's next
step, whose kernels read the ``lr`` the scheduler writes, and ``state_dict()`` /
``get_last_lr()`` of a skip-aware scheduler settle it first. On CPU the copy is immediate, so
every decision is taken at once. A scheduler whose optimizer has no gate steps as usual.
"""
from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
from torch import Tensor

_GATES: "weakref.WeakKeyDictionary[Any, StepGate]" = weakref.WeakKeyDictionary()


class StepGate:
    """Host copies of one optimizer's per-step ``found_inf`` flags (see the module docstring).

    Args:
        on_skip: called once per skipped step, when its flag reaches the host (in step order).
    """

    def __init__(self, on_skip: Callable[[], None]) -> None:
        self._on_skip = on_skip
        self._pending: Deque[Tuple[int, Any, Any, Optional[Any]]] = deque()  # (index, host, view, event)
        self._pool: List[Tuple[Any, Any, Optional[Any]]] = []
        self._deferred: List[Tuple[int, Callable[[], Any]]] = []
        self._recorded = 0
        self.last_skipped = False  # of the newest settled step

    def attach(self, optimizer: Any) -> None:
        """Make ``optimizer``'s skip-aware schedulers consult this gate."""
        _GATES[optimizer] = self

    def record(self, found_inf: Tensor) -> None:
        """After a step: start the non-blocking copy of its ``found_inf`` (0-dim) to the host."""
        if self._pool:
            host, view, event = self._pool.pop()
        else:
            cuda = found_inf.device.type == "cuda"
            host = torch.empty(1, dtype=torch.float32, pin_memory=cuda)
            view, event = host.numpy(), (torch.cuda.Event() if cuda else None)
        host.copy_(found_inf.detach().reshape(1), non_blocking=True)
        if event is not None:
            event.record()
        self._recorded += 1
        self._pending.append((self._recorded, host, view, event))
        self.poll()

    def poll(self, wait: bool = False) -> None:
        """Settle every step whose flag has reached the host (all of them with ``wait``), in order."""
        while self._pending:
            index, host, view, event = self._pending[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._pending.popleft()
            self._pool.append((host, view, event))
            self.last_skipped = bool(view[0] != 0)
            if self.last_skipped:
                self._on_skip()
            due = [fn for i, fn in self._deferred if i == index]
            self._deferred = [(i, fn) for i, fn in self._deferred if i != index]
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
    return _GATES.get(getattr(optimizer, "_optimizer", optimizer))


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
