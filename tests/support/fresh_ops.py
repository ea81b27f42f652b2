"""An independent copy of the ``lightning_amp.ops`` package, for the tests of how its loader reacts to a missing,
disabled or unbuildable extension without a fresh interpreter (cheaper than a subprocess)."""
import importlib.util
import os
import sys

from lightning_amp import ops


def fresh_ops_module(name):
    """A new, independent copy of the lightning_amp/ops package, executed under the current patches.

    Its torch.library operators are the process's own (``_library`` is shared: an operator is
    registered once per process); the copy calls them only when its own loader found the extension."""
    here = os.path.dirname(ops.__file__)
    spec = importlib.util.spec_from_file_location(name, ops.__file__, submodule_search_locations=[here])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.modules[f"{name}._library"] = ops._library
    try:
        spec.loader.exec_module(module)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
    return module
