"""The import paths that moved (issue 40's folders) keep working for one release, with a DeprecationWarning
naming the new path, and give the very module at the new path (one set of classes: an ``isinstance`` or a
monkeypatch through either path meets the same objects)."""
import importlib
import sys
import warnings

import pytest

import lightning_amp
from lightning_amp._moved import MOVED


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_path_warns_and_is_the_new_module(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # as in a fresh process: the old path not yet imported
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}; the old import path works through release 0.2"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module


def test_the_old_names_are_the_same_objects():
    for old in ("lightning_amp.precision", "lightning_amp.parallel.strategy"):
        sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning):
        from lightning_amp.precision import AmpO2Precision
        from lightning_amp.parallel.strategy import TensorParallelStrategy
    assert AmpO2Precision is lightning_amp.AmpO2Precision
    assert TensorParallelStrategy is lightning_amp.TensorParallelStrategy
    import lightning_amp.parallel as parallel

    with pytest.warns(DeprecationWarning, match="lightning_amp.parallel.strategy moved to lightning_amp.trainer.strategy"):
        assert parallel.TensorParallelStrategy is lightning_amp.TensorParallelStrategy


def test_the_new_paths_and_the_package_import_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for new in sorted(set(MOVED.values()) | {"lightning_amp.trainer", "lightning_amp.amp.ladder", "lightning_amp.amp.o2"}):
            importlib.import_module(new)
        from lightning_amp.amp.ladder import AmpLadder, LadderRules  # the package keeps the old module's names

        assert AmpLadder.__module__ == "lightning_amp.amp.ladder.ladder"
        assert LadderRules is lightning_amp.LadderRules


def test_no_module_of_the_package_imports_an_old_path():
    import ast
    import pathlib

    root = pathlib.Path(lightning_amp.__file__).parent
    shims = {root / (old.removeprefix("lightning_amp.").replace(".", "/") + ".py") for old in MOVED}
    offending = []
    for path in sorted(root.rglob("*.py")):
        if path in shims:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:  # `from a.b import c` may import the module a.b.c
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offending += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n in MOVED]
    assert offending == []
