"""Every process-wide change the package makes, applied and undone here, and what is active now.

A process-wide change outlives the object that asked for it unless something undoes it: a torch function
patched, a kernel registered on autocast's dispatch keys, a global module hook. Each is a
:class:`ProcessChange`: reference-counted across threads (the first holder applies it, the last one undoes it,
under one lock), named, and listed in :data:`CHANGES`, so :func:`active` can say what is in effect now, e.g.
``{"torch functions patched by the cast lists": 1}`` inside an O1 forward and ``{}`` after a run. The
modules that own a mechanism give it its apply and undo functions (:mod:`~lightning_amp.amp.casts`,
:mod:`~lightning_amp.amp.function_backward`, :mod:`~lightning_amp.amp.o2.policy`,
:mod:`~lightning_amp.amp.recompute`; above ``amp/``, the Lightning glue registers the Lightning objects our plugins
wrap while they are about: ``lightning_amp.plugin_kinds`` and ``lightning_amp.trainer.precision``, imported by
``import lightning_amp`` before this module is); the counting, the locking and the report live here only.

docs/architecture.md ("Process-wide state") lists each change, its fence and the test that it is gone after
a run; ``tests/amp/test_process_state.py`` holds that table and :data:`CHANGES` to each other.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Optional


class ProcessChange:
    """One process-wide change (see the module docstring).

    Args:
        name: what is changed, as a person reads it (the key of :func:`active` and of :data:`CHANGES`).
        apply: makes the change; what it returns is handed to ``undo``.
        undo: ``undo(token)`` puts back what ``apply`` changed.
    """

    def __init__(self, name: str, apply: Callable[[], Any], undo: Callable[[Any], None]) -> None:
        if name in CHANGES:
            raise ValueError(f"a process-wide change named {name!r} is already registered")
        self.name, self._apply, self._undo = name, apply, undo
        self._lock = threading.RLock()
        self._holders = 0
        self._token: Any = None
        CHANGES[name] = self

    def acquire(self) -> None:
        """Hold the change: applied if no one held it (an ``apply`` that raises leaves nothing held)."""
        with self._lock:
            if self._holders == 0:
                self._token = self._apply()
            self._holders += 1

    def release(self) -> None:
        """Give a hold back: the last one undoes the change."""
        with self._lock:
            if self._holders == 0:
                raise RuntimeError(f"{self.name}: released more often than acquired")
            self._holders -= 1
            if self._holders == 0:
                token, self._token = self._token, None
                self._undo(token)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The change held for the block."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    @property
    def holders(self) -> int:
        """How many holds are open now, all threads (0: the change is not in effect)."""
        with self._lock:
            return self._holders


class CountedElsewhere:
    """A process-wide change whose holds are counted where it is made (O2's kernels: in the compiled extension),
    listed here so that :func:`active` reports it: ``holders`` reads that count."""

    def __init__(self, name: str, holders: Callable[[], int]) -> None:
        if name in CHANGES:
            raise ValueError(f"a process-wide change named {name!r} is already registered")
        self.name, self._holders = name, holders
        CHANGES[name] = self

    @property
    def holders(self) -> int:
        return int(self._holders())


#: every process-wide change, by name (filled as the owning modules are imported: :func:`active` imports them)
CHANGES: Dict[str, Any] = {}

_OWNERS = ("casts", "function_backward", "module_cast", "o2.policy", "recompute")


def active(name: Optional[str] = None) -> Dict[str, int]:
    """The process-wide changes in effect now and their open holds (``{}``: torch and the process are as they
    were); ``name`` restricts the answer to one change (KeyError for an unknown name)."""
    import importlib

    for owner in _OWNERS:  # their changes register themselves when imported
        importlib.import_module(f"lightning_amp.amp.{owner}")
    changes = CHANGES if name is None else {name: CHANGES[name]}
    return {change.name: change.holders for change in changes.values() if change.holders}
