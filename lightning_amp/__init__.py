"""lightning-amp: Apex-style mixed precision, fused optimizers and fused tensor parallelism for Lightning.

``import lightning_amp`` imports every public name (:mod:`lightning_amp._public`), registering
``strategy="tp_fused"`` with Lightning; in the ``lightning-amp`` command they import on first use instead, so
that its argument parsing and ``--help`` import no torch (:mod:`lightning_amp._command`).
"""
import importlib

from lightning_amp._command import started_as_command as _started_as_command
from lightning_amp._moved import install_old_paths as _install_old_paths
from lightning_amp._version import version as _version

__version__ = _version()
_install_old_paths()

if _started_as_command():
    def __getattr__(name: str):
        if name.startswith("_") and name != "__all__":  # a submodule probed by `from lightning_amp import _x`
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module("lightning_amp._public"), name)
else:
    from lightning_amp._public import *  # noqa: F401,F403
    from lightning_amp._public import __all__  # noqa: F401
