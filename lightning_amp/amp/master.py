"""Deprecated: the former name of :mod:`lightning_amp.amp.param_views` (it never held master weights)."""
import warnings

from lightning_amp.amp.param_views import optimizer_grads, optimizer_params, param_name

warnings.warn("lightning_amp.amp.master is deprecated: use lightning_amp.amp.param_views (same functions; the "
              "module holds views of an optimizer's params, no master weights)", DeprecationWarning, stacklevel=2)

__all__ = ["optimizer_grads", "optimizer_params", "param_name"]
