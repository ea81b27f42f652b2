"""The import paths that moved (issue 40's folders) keep working for one release, with a DeprecationWarning
naming the new path, and give the very module at the new path (one set of classes: an ``isinstance`` or a
monkeypatch through either path meets the same objects)."""
import importlib
import sys
import warnings

import pytest

import lightning_amp
from lightning_amp import strategy_base
from lightning_amp._moved import MOVED
from lightning_amp.amp.ladder import rules as ladder_rules, snapshot as ladder_snapshot
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.parallel import comm, convert, fused_qkv
from lightning_amp.parallel.reading import between, dataflow, families, forward_graph, heads, model_reading, projections, qkv_heads, structure, unsplit
from lightning_amp.trainer import precision as trainer_precision, strategy as trainer_strategy


#: each old path -> the module it must be (imported here by its new path, not read from MOVED) and names that
#: module defines: an old path aliased to the wrong module, or MOVED naming the wrong target, fails
OLD_PATHS = {
    "lightning_amp.precision": (trainer_precision, ("AmpPrecision", "AmpO2Precision", "AmpO2Plugin", "main_params")),
    "lightning_amp.parallel.strategy": (trainer_strategy, ("TensorParallelStrategy",)),
    "lightning_amp.parallel.strategy_mixin": (strategy_base, ("TensorParallelStrategyMixin", "conversion_report")),
    "lightning_amp.amp.ladder_rules": (ladder_rules, ("LadderRules", "RungWatch", "check_ladder", "FP16_LADDER")),
    "lightning_amp.amp.ladder_snapshot": (ladder_snapshot, ("SnapshotStore", "Snapshot", "to_host")),
    "lightning_amp.amp.o2_policy": (o2_policy, ("hold", "held", "installs", "forward", "table")),
    # issue 47's moves: no file at the old path (lightning_amp._moved.OldPathFinder)
    "lightning_amp.parallel.auto_units": (model_reading, ("read_model", "ModelReading")),
    "lightning_amp.parallel.between": (between, ("between_problem",)),
    "lightning_amp.parallel.data_flow": (dataflow, ("products", "reach", "sources")),
    "lightning_amp.parallel.families": (families, ("Unit", "find_units", "HEAD_ATTRS")),
    "lightning_amp.parallel.forward_graph": (forward_graph, ("read_forward", "ForwardGraph")),
    "lightning_amp.parallel.heads": (heads, ("AttentionShape", "attention_unit")),
    "lightning_amp.parallel.projections": (projections, ("is_projection", "is_conv1d", "widths_of")),
    "lightning_amp.parallel.qkv_heads": (qkv_heads, ("QKVHeads",)),
    "lightning_amp.parallel.structure": (structure, ("find_structural_units",)),
    "lightning_amp.parallel.unsplit": (unsplit, ("whole_attentions", "why_not_split")),
    "lightning_amp.parallel.report": (convert, ("PlanReport", "SplitUnit", "Conversion")),
    "lightning_amp.parallel.shared_input": (comm, ("SharedInput",)),
    "lightning_amp.parallel.replicated_heads": (fused_qkv, ("ReplicatedHeadsLinear",)),
}


def test_every_moved_path_is_checked_here():
    assert sorted(OLD_PATHS) == sorted(MOVED)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_warns_and_is_the_new_module(old, monkeypatch):
    module, names = OLD_PATHS[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # as in a fresh process: the old path not yet imported
    with pytest.warns(DeprecationWarning,
                      match=rf"{old} moved to {module.__name__}; the old import path works through release 0.2"):
        imported = importlib.import_module(old)
    assert imported is module and imported.__name__ == module.__name__
    assert sys.modules[old] is module
    assert [name for name in names if getattr(imported, name, None) is not vars(module).get(name, "missing")] == []


def test_our_deprecation_warnings_are_errors_in_the_test_settings(monkeypatch):
    """pyproject's filterwarnings: a DeprecationWarning of ours (an old path imported anywhere, by the package too)
    fails the test that meets it, where other packages' are ignored."""
    monkeypatch.delitem(sys.modules, "lightning_amp.amp.ladder_rules", raising=False)
    with pytest.raises(DeprecationWarning, match="lightning_amp.amp.ladder_rules moved to"):
        importlib.import_module("lightning_amp.amp.ladder_rules")
    with pytest.raises(DeprecationWarning, match="torch's deprecation met in our code"):  # attributed to a module of ours
        warnings.warn_explicit("torch's deprecation met in our code", DeprecationWarning, "step.py", 1,
                               module="lightning_amp.amp.step")
    warnings.warn("another package's deprecation", DeprecationWarning)  # ignored: no error


def test_process_state_reports_without_an_old_path(monkeypatch):
    """``process_state.active()`` imports every owner of a change by its new path (it imported ``amp.o2_policy``)."""
    from lightning_amp.amp import process_state

    for old in MOVED:
        monkeypatch.delitem(sys.modules, old, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        process_state.active()
    assert [old for old in MOVED if old in sys.modules] == []


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
