"""Constructor keywords checked against what the class takes, and errors that name the fix.

``@checks_keywords`` on a class wraps its ``__init__``:

* a keyword it does not take raises ``TypeError`` (as Python's own) before the constructor runs, naming the
  class, the keyword and the closest keyword it takes ("did you mean ...?", :func:`difflib.get_close_matches`),
  or, when none is close, every keyword it takes;
* with ``apex_options=True`` (the precision plugins) an option of apex's ``amp.initialize`` that lightning-amp
  does not have names what to use instead (:data:`APEX_ONLY_OPTIONS`: the table of docs/migrating-from-apex.md,
  kept equal to it by a test);
* a ``TypeError`` or ``ValueError`` (a bad value) raised while the outermost checked constructor runs gets the
  class's name in front of its message, unless the message names it already.

The keywords a constructor takes are its named parameters, and where it has ``**kwargs`` those of the next
constructor in the class's MRO, up to one without ``**kwargs``. (``strategy="tp_fused"`` names every keyword it
takes, Lightning's ``DDPStrategy``'s ``timeout``, ``start_method``, ... among them, and has no ``**kwargs``: LightningCLI
reads the signature, and would otherwise follow ``**kwargs`` to torch's ``DistributedDataParallel`` options, which
tp_fused, with no DDP wrapper, refuses.)

Imports nothing of lightning-amp, torch or Lightning (``tests/test_import_layers.py``).
"""
from __future__ import annotations

import contextvars
import difflib
import functools
import inspect
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Tuple, TypeVar

APEX_ONLY_OPTIONS: Mapping[str, str] = {
    "enabled": "leave the plugin out instead",
    "patch_torch_functions": "drop it: O1 always runs under torch.autocast",
    "num_losses": "drop it: each optimizer has its own loss scaler; port a loop with several losses to manual "
                  "optimization, one manual_backward per apex scale_loss (Several losses and optimizers)",
    "verbosity": "drop it and set the level of the lightning_amp.amp.engine logger",
    "cast_model_type": "use dtype, the half type of O1-O3 (dtype=\"float16\" as in apex)",
}
"""Options of apex's ``amp.initialize`` with no counterpart here -> what to do instead (the migration page's table)."""

_MIGRATION_PAGE = "docs/migrating-from-apex.md"
_depth = contextvars.ContextVar("lightning_amp_checked_constructors", default=0)
C = TypeVar("C", bound=type)


def accepted_keywords(cls: type) -> Tuple[str, ...]:
    """The keywords ``cls(...)`` takes: its ``__init__``'s named parameters, followed up the MRO through
    ``**kwargs``."""
    names: list = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return tuple(names)


def closest(name: str, choices: Iterable[str]) -> str:
    """The choice closest to ``name`` (difflib's ratio of at least 0.6), or "" when none is close."""
    found = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return found[0] if found else ""


def unknown_keyword_message(owner: str, keyword: str, accepted: Iterable[str], apex_options: bool = False) -> str:
    """Why ``owner`` refuses ``keyword`` and what to write instead (see the module docstring)."""
    accepted = tuple(accepted)
    if apex_options and keyword in APEX_ONLY_OPTIONS:
        return (f"{owner}() got an unexpected keyword argument {keyword!r}, an option of apex's amp.initialize that "
                f"lightning-amp does not have; {APEX_ONLY_OPTIONS[keyword]} (see {_MIGRATION_PAGE})")
    near = closest(keyword, accepted)
    hint = f"did you mean {near!r}?" if near else f"it takes {', '.join(accepted)}"
    return f"{owner}() got an unexpected keyword argument {keyword!r}; {hint}"


def check_keywords(owner: str, given: Iterable[str], accepted: Iterable[str], apex_options: bool = False) -> None:
    """TypeError naming each of ``given`` that is not in ``accepted`` (:func:`unknown_keyword_message`)."""
    accepted = tuple(accepted)
    unknown = [key for key in given if key not in accepted]
    if unknown:
        raise TypeError("; ".join(unknown_keyword_message(owner, key, accepted, apex_options) for key in unknown))


def _name_in(err: Exception, owner: str) -> None:
    """Put ``owner`` in front of ``err``'s message, unless the message names it already."""
    if err.args and isinstance(err.args[0], str) and not re.search(rf"\b{re.escape(owner)}\b", err.args[0]):
        err.args = (f"{owner}: {err.args[0]}", *err.args[1:])


def checks_keywords(cls: Optional[C] = None, *, apex_options: bool = False) -> Any:
    """Class decorator: ``cls``'s constructor checks its keywords and names the class in its errors (see the
    module docstring)."""
    if cls is None:
        return functools.partial(checks_keywords, apex_options=apex_options)
    init: Callable[..., None] = vars(cls)["__init__"]
    accepted = accepted_keywords(cls)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        owner = type(self).__name__
        check_keywords(owner, kwargs, accepted, apex_options)
        outermost = _depth.get() == 0
        token = _depth.set(_depth.get() + 1)
        try:
            init(self, *args, **kwargs)
        except (TypeError, ValueError) as err:
            if outermost:
                _name_in(err, owner)
            raise
        finally:
            _depth.reset(token)

    cls.__init__ = __init__
    return cls
