"""A lightning-amp plugin handed to the other Lightning is refused when that Trainer or Fabric is constructed.

The Trainer plugins (``AmpPrecision``, ``AmpO2Precision``, ...) are Lightning Trainer ``Precision`` objects,
and Lightning's Trainer ``Precision`` derives from Fabric's: ``Fabric(plugins=[AmpO2Precision()])`` passes
Fabric's own check (``isinstance(plugin, Precision)`` in ``lightning.fabric.connector``), and Fabric calls
nothing of its precision plugin before ``fabric.setup``, where the plugin found no Trainer and raised. A
plugin cannot know at its own construction which Lightning will hold it, and Lightning has no hook for it, so
the check is added where each Lightning reads its ``plugins=`` and ``precision=`` arguments: the constructors
of Fabric's ``_Connector`` and of the Trainer's ``_AcceleratorConnector`` are wrapped to raise TypeError naming
the class to use before anything else runs, and, once Lightning built the connector, to tell each plugin of ours
what it was given to (Fabric hands its precision plugin no strategy: its plugin checks it there, before
``fabric.setup`` casts anything). Any other argument gets Lightning's own answer: the wrappers only look. The
wrapping is a process-wide change (:data:`WRAPPED_CONNECTORS`, :mod:`~lightning_amp.amp.process_state`): every
plugin of ours holds it from its construction until its teardown (or its collection), so Lightning's
constructors are its own again once no plugin of ours is about. (Lightning's Trainer refused a Fabric
plugin already, with "Found invalid type for plugin", which did not say what to pass instead.)
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Iterable

from lightning.fabric import connector as fabric_connector
from lightning.pytorch.trainer.connectors import accelerator_connector as trainer_connector

from lightning_amp.amp.process_state import ProcessChange
from lightning_amp.fabric.precision import FabricAmpPrecision
from lightning_amp.plugin_base import CONNECTORS_CHANGE, AmpPluginBase, plugin_name
from lightning_amp.trainer.precision import AmpPrecision


def wrong_lightning(plugin: AmpPluginBase) -> TypeError:
    """The error for ``plugin`` given to the other Lightning, naming the class with its options for this one."""
    if plugin.kind == "trainer":
        this, other, call, module = "Trainer", "fabric", "L.Fabric", "lightning_amp.fabric"
    else:
        this, other, call, module = "Fabric", "trainer", "L.Trainer", "lightning_amp"
    name = plugin_name(other, plugin.fixed_opt_level)
    return TypeError(f"{type(plugin).__name__} is a Lightning {this} plugin; {call} takes {module}.{name}, with the "
                     f"same options: `{call}(plugins=[{name}(...)])`.")

def _given(plugins: Any, precision: Any) -> Iterable[Any]:
    """The objects of a ``plugins=`` argument (one, or an iterable of them) and a ``precision=`` argument."""
    if plugins is None:
        plugins = []
    elif isinstance(plugins, (str, AmpPluginBase)) or not isinstance(plugins, Iterable):
        plugins = [plugins]
    return [*plugins, precision]


def _checking(connector: type, wrong: type, init: Callable[..., None]) -> Callable[..., None]:
    """``connector.__init__`` (``init``) that raises :func:`wrong_lightning` first for a ``wrong`` plugin among its
    ``plugins``/``precision`` arguments and, once Lightning built it, tells each plugin of ours what it was given to
    (:meth:`~lightning_amp.plugin_base.AmpPluginBase.given_to_lightning`: Fabric's plugin checks the strategy)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = signature.bind_partial(self, *args, **kwargs).arguments
        ours = [p for p in _given(given.get("plugins"), given.get("precision")) if isinstance(p, AmpPluginBase)]
        for plugin in ours:
            if isinstance(plugin, wrong):
                raise wrong_lightning(plugin)
        init(self, *args, **kwargs)
        for plugin in ours:
            plugin.given_to_lightning(self)

    return __init__


_CONNECTORS = ((fabric_connector._Connector, AmpPrecision), (trainer_connector._AcceleratorConnector, FabricAmpPrecision))


def _wrap_connectors() -> Dict[type, Callable[..., None]]:
    """Wrap the constructors (a Lightning without the ``plugins`` argument is left alone: the plugin is refused at
    setup, as before); what they were, for :func:`_unwrap_connectors`."""
    originals = {}
    for connector, wrong in _CONNECTORS:
        init = connector.__init__
        if "plugins" in inspect.signature(init).parameters:
            originals[connector] = init
            connector.__init__ = _checking(connector, wrong, init)
    return originals


def _unwrap_connectors(originals: Dict[type, Callable[..., None]]) -> None:
    for connector, init in originals.items():
        connector.__init__ = init


#: held by every plugin of ours from its construction to its teardown (:meth:`AmpPluginBase.hold_lightning_changes`)
WRAPPED_CONNECTORS = ProcessChange(CONNECTORS_CHANGE, _wrap_connectors, _unwrap_connectors)
