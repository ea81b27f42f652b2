"""The package's layers as imports: ``amp/`` imports nothing above it (no Lightning, no optimizers,
parallel or plugin modules) and its modules import one another without a circle; below it, the tables and
helpers every layer and the command line read import nothing of the package, torch or Lightning."""
import ast
import pathlib

import lightning_amp

_AMP = pathlib.Path(lightning_amp.__file__).parent / "amp"
#: imported by every layer and by the ``lightning-amp`` command's argument parsing, which imports no torch
_BOTTOM = ("lightning_amp._keywords", "lightning_amp._dtype_names", "lightning_amp._command", "lightning_amp._moved")
_BELOW_AMP = ("lightning_amp.amp", "lightning_amp.ops", *_BOTTOM)


def _imports(path: pathlib.Path) -> list:
    """Every module ``path`` imports (at any depth: lazy imports inside functions count too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            if node.module == "lightning_amp":
                names.extend(f"lightning_amp.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_amp_imports_nothing_above_it():
    offending = {}
    for path in sorted(_AMP.rglob("*.py")):  # the sub-packages (ladder/, o2/) too
        up = [m for m in _imports(path) if (m.startswith("lightning_amp.") and not m.startswith(_BELOW_AMP))
              or m.split(".")[0] in ("lightning", "pytorch_lightning")]
        if up:
            offending[str(path.relative_to(_AMP))] = up
    assert not offending, f"amp/ imports upwards: {offending}"


_PARALLEL = _AMP.parent / "parallel"
_BELOW_PARALLEL = ("lightning_amp.parallel", "lightning_amp.amp", "lightning_amp.ops", *_BOTTOM)


def test_parallel_imports_no_lightning_and_no_glue():
    """The tensor-parallel machinery is framework-free: the strategies (trainer/, fabric/, strategy_base.py) drive it
    through TensorParallelRuntime; nothing in parallel/ imports Lightning or a module above it (the files at old
    import paths excepted: they only point at the new ones)."""
    offending = {}
    for path in sorted(_PARALLEL.rglob("*.py")):
        if path.name in ("strategy.py", "strategy_mixin.py"):  # old paths (lightning_amp._moved)
            continue
        up = [m for m in _imports(path) if (m.startswith("lightning_amp.") and not m.startswith(_BELOW_PARALLEL))
              or m.split(".")[0] in ("lightning", "pytorch_lightning")]
        if up:
            offending[path.name] = up
    assert not offending, f"parallel/ imports upwards: {offending}"


def test_amp_modules_import_no_circle():
    def name(path):  # "runtime", "ladder.rules": a module's dotted path under amp/
        return ".".join(path.relative_to(_AMP).with_suffix("").parts)

    modules = {name(path) for path in _AMP.rglob("*.py") if path.name != "__init__.py"}
    graph = {}
    for path in sorted(_AMP.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        imported = {m.removeprefix("lightning_amp.amp.") for m in _imports(path) if m.startswith("lightning_amp.amp.")}
        graph[name(path)] = (imported & modules) - {name(path)}

    def cycle_from(node, trail):
        if node in trail:
            return trail[trail.index(node):] + [node]
        for nxt in sorted(graph.get(node, ())):
            found = cycle_from(nxt, trail + [node])
            if found:
                return found
        return None

    for start in graph:
        found = cycle_from(start, [])
        assert found is None, f"import circle in amp/: {' -> '.join(found)}"


_LADDER_SEQUENCING = {"before_step", "after_step", "rollback", "moved", "landed", "check_rungs", "load_state_dict",
                      "state_dict"}


def test_nothing_outside_amp_reaches_past_the_runtime_into_its_engine_or_ladder():
    """The plugins, strategies and tools talk to ``AmpRuntime`` (``plugin.amp``) only: no ``.engine`` attribute is
    read outside amp/, and the ladder's sequencing (``before_step``, ``after_step``, ...) is called by the runtime
    alone, so the Trainer and Fabric plugins share one implementation of it."""
    package = _AMP.parent
    offending = []
    for path in sorted(package.rglob("*.py")):
        if _AMP in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            reaches_engine = node.attr == "engine"
            drives_ladder = (node.attr in _LADDER_SEQUENCING and isinstance(node.value, ast.Attribute)
                             and node.value.attr == "ladder")
            if reaches_engine or drives_ladder:
                offending.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
    assert offending == []


def test_the_bottom_modules_import_nothing_of_the_package_torch_or_lightning():
    root = _AMP.parent
    for module in _BOTTOM:
        imports = _imports(root / f"{module.split('.')[1]}.py")
        up = [m for m in imports if m.split(".")[0] in ("lightning_amp", "torch", "lightning", "pytorch_lightning")]
        assert not up, f"{module} imports {up}"


#: what amp/ladder/ may import of the package: itself, the levels and the keyword checks (no runtime, engine, step)
_LADDER_MAY_IMPORT = ("lightning_amp.amp.ladder", "lightning_amp.amp.levels", "lightning_amp._keywords")
#: the runtime's and the engine's members a client of theirs would reach for
_RUNTIME_MEMBERS = {"engine", "change_level", "scalers", "gate", "watchers", "last_skipped", "request",
                    "properties", "rollback_objects", "rollback_extras", "last_nonfinite_params", "poll"}


def test_the_ladder_is_a_client_of_the_runtime():
    """amp/ladder/ decides from what it is told and returns decisions (docs/architecture.md): it imports nothing of the
    runtime, the engine or the step, takes no ``runtime``/``engine`` argument and reads none of their members, so it
    can keep no reference to them; the runtime applies its decisions."""
    offending = []
    for path in sorted((_AMP / "ladder").rglob("*.py")):
        where = path.relative_to(_AMP)
        offending += [f"{where}: imports {m}" for m in _imports(path)
                      if m.startswith("lightning_amp") and not m.startswith(_LADDER_MAY_IMPORT)]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.arg in ("runtime", "engine", "amp"):
                offending.append(f"{where}:{node.lineno} takes `{node.arg}`")
            elif isinstance(node, ast.Attribute) and node.attr in _RUNTIME_MEMBERS:
                offending.append(f"{where}:{node.lineno} reads .{node.attr}")
    assert offending == []


def test_no_module_reads_its_callers_frames_by_a_private_name():
    """No hidden reach (issue 48): nothing in the package finds an object through ``sys._getframe`` (the Fabric plugin
    once found its strategy so); the stream warning walks the stack from ``inspect.currentframe()`` to name the
    user's line, as a warning's stacklevel does."""
    package = pathlib.Path(lightning_amp.__file__).parent
    reaching = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_getframe":
                reaching.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not reaching, reaching
