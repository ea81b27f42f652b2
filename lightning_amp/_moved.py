"""Old import paths of modules that moved: each old path imports the new module, warns once, and is that module.

A module at an old path calls :func:`alias` with its own ``__name__``; the import then yields the new module
itself (``lightning_amp.precision is lightning_amp.trainer.precision``), so a monkeypatch or an ``isinstance``
through the old path meets the same objects. An old path with no file there (the moves of issue 47, whose files
moved with ``git mv`` so that merges follow them) is served the same way by :class:`OldPathFinder`, which
``import lightning_amp`` installs. The old paths work through release 0.2 and are removed after it.
"""
import importlib
import importlib.abc
import importlib.util
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
    # issue 47: the model reading in its own sub-package; the plan report beside the conversion that makes it
    **{f"lightning_amp.parallel.{name}": f"lightning_amp.parallel.reading.{name}"
       for name in ("between", "families", "forward_graph", "heads", "qkv_heads", "structure", "unsplit")},
    "lightning_amp.parallel.auto_units": "lightning_amp.parallel.reading.model_reading",  # the model read once
    # the layers and ops a reading knows, and the walks along its data, beside the graph they read
    "lightning_amp.parallel.data_flow": "lightning_amp.parallel.reading.dataflow",
    "lightning_amp.parallel.projections": "lightning_amp.parallel.reading.projections",
    "lightning_amp.parallel.replicated_heads": "lightning_amp.parallel.fused_qkv",  # key/value heads kept whole: one home
    "lightning_amp.parallel.report": "lightning_amp.parallel.convert",
    "lightning_amp.parallel.shared_input": "lightning_amp.parallel.comm",
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


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an old path of :data:`MOVED` that has no file of its own: the import is :func:`alias`'s (a warning,
    then the new module itself). Last on ``sys.meta_path``, so a file at an old path is found first."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        return alias(spec.name)

    def exec_module(self, module) -> None:
        """Nothing to run: the module at the new path was imported by :meth:`create_module`."""


def install_old_paths() -> None:
    """Put one :class:`OldPathFinder` last on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
