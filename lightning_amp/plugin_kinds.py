"""A lightning-amp plugin handed to the other Lightning is refused when that Trainer or Fabric is constructed.

The Trainer plugins (``AmpPrecision``, ``AmpO2Precision``, ...) are Lightning Trainer ``Precision`` objects,
and Lightning's Trainer ``Precision`` derives from Fabric's: ``Fabric(plugins=[AmpO2Precision()])`` passes
Fabric's own check (``isinstance(plugin, Precision)`` in ``lightning.fabric.connector``), and Fabric calls
nothing of its precision plugin before ``fabric.setup``, where the plugin found no Trainer and raised. A
plugin cannot know at its own construction which Lightning will hold it, and Lightning has no hook for it, so
the check is added where each Lightning reads its ``plugins=`` and ``precision=`` arguments: the constructors
of Fabric's ``_Connector`` and of the Trainer's ``_AcceleratorConnector`` are wrapped (once, when
``lightning_amp`` is imported) to raise TypeError naming the class to use before anything else runs. Any
other argument gets Lightning's own answer: the wrappers only look. (Lightning's Trainer refused a Fabric
plugin already, with "Found invalid type for plugin", which did not say what to pass instead.)
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Iterable

from lightning.fabric import connector as fabric_connector
from lightning.pytorch.trainer.connectors import accelerator_connector as trainer_connector

from lightning_amp.fabric.precision import FabricAmpPrecision
from lightning_amp.plugin_base import AmpPluginBase, plugin_name
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


def refuse_wrong_kind_first(connector: type, wrong: type) -> None:
    """Wrap ``connector.__init__`` so that a ``wrong`` plugin among its ``plugins``/``precision`` arguments raises
    :func:`wrong_lightning` first (once: a second call leaves the wrapper as it is; a Lightning without the class's
    ``plugins`` argument is left alone, and the plugin is refused at setup as before)."""
    init = connector.__init__
    signature = inspect.signature(init)
    if getattr(init, "_lightning_amp", False) or "plugins" not in signature.parameters:
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = signature.bind_partial(self, *args, **kwargs).arguments
        for plugin in _given(given.get("plugins"), given.get("precision")):
            if isinstance(plugin, wrong):
                raise wrong_lightning(plugin)
        init(self, *args, **kwargs)

    __init__._lightning_amp = True  # type: ignore[attr-defined]
    connector.__init__ = __init__


refuse_wrong_kind_first(fabric_connector._Connector, AmpPrecision)
refuse_wrong_kind_first(trainer_connector._AcceleratorConnector, FabricAmpPrecision)
