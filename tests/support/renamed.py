"""Copies of other people's classes with their attributes renamed to arbitrary names: the class's own source with
every ``.old`` attribute access replaced by ``.new``, executed in its module's namespace, and models whose instances
are switched to the renamed class with their attributes (children, params, ints, configs) renamed alike. What the
plan finds in a renamed model it found by structure: no name of the original is left. Instances pickle (a spawned
rank rebuilds the renamed class from the original and the names)."""
from __future__ import annotations

import functools
import inspect
import re
import sys
import textwrap

from torch import nn


def renamed_class(cls: type, names: dict[str, str]) -> type:
    """``cls`` compiled from its own source with the attribute accesses ``.old`` of ``names`` written ``.new`` (one
    class per ``cls`` and ``names`` in a process)."""
    return _renamed(cls, tuple(names.items()))


def _rebuild(cls: type, names: tuple, state: dict) -> nn.Module:
    renamed = _renamed(cls, names)
    module = renamed.__new__(renamed)
    module.__setstate__(state)
    return module


@functools.lru_cache(maxsize=None)
def _renamed(cls: type, pairs: tuple) -> type:
    names = dict(pairs)
    source = textwrap.dedent(inspect.getsource(cls))
    for old, new in names.items():
        source = re.sub(rf"(?<=\.){re.escape(old)}\b", new, source)
        source = re.sub(rf"(?<=getattr\(self, \"){re.escape(old)}(?=\")", new, source)
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(compile(source, f"<{cls.__qualname__} renamed>", "exec"), namespace)  # noqa: S102 (the class's own code)
    renamed = namespace[cls.__name__]
    renamed.__qualname__ = renamed.__name__ = f"Renamed{cls.__name__}"
    renamed.__reduce_ex__ = lambda self, protocol: (_rebuild, (cls, pairs, self.__getstate__()))
    return renamed


def rename_instances(model: nn.Module, cls: type, names: dict[str, str]) -> nn.Module:
    """Every ``cls`` instance in ``model`` switched to :func:`renamed_class` with its attributes renamed; returns
    ``model`` (same params, same values)."""
    renamed = renamed_class(cls, names)
    for module in list(model.modules()):
        if type(module) is cls:
            state = vars(module)
            for table in ("_modules", "_parameters", "_buffers"):
                state[table] = {names.get(k, k): v for k, v in state[table].items()}
            for old, new in names.items():
                if old in state:
                    state[new] = state.pop(old)
            module.__class__ = renamed
    return model
