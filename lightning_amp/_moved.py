"""Old import paths of modules that moved: each old path imports the new module, warns once, and is that module.

A module at an old path calls :func:`alias` with its own ``__name__``; the import then yields the new module
itself (``lightning_amp.precision is lightning_amp.trainer.precision``), so a monkeypatch or an ``isinstance``
through the old path meets the same objects. The old paths work through release 0.2 and are removed after it.
"""
import importlib
import sys
import warnings
from types import ModuleType

#: old import path -> new import path (the moves of issue 40; docs/architecture.md, "Layout")
MOVED = {
    "lightning_amp.precision": "lightning_amp.trainer.precision",
    "lightning_amp.parallel.strategy": "lightning_amp.trainer.strategy",
    "lightning_amp.parallel.strategy_mixin": "lightning_amp.strategy_base",
    "lightning_amp.amp.ladder_rules": "lightning_amp.amp.ladder.rules",
    "lightning_amp.amp.ladder_snapshot": "lightning_amp.amp.ladder.snapshot",
    "lightning_amp.amp.o2_policy": "lightning_amp.amp.o2.policy",
}


def alias(old: str) -> ModuleType:
    """Make the module importing as ``old`` the module at its new path (:data:`MOVED`), with a
    DeprecationWarning naming both."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old import path works through release 0.2 and is removed after it",
                  DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
