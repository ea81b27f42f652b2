"""The suite's layout: what tests share lives in the package ``tests/support/``, and tests import it from there only.

Outside ``tests/support/`` every module is a test module (``test_*.py``) or a ``conftest.py``; no module of the
suite imports a test module, a ``conftest``, ``tests.<anything>``, or a module of ``support`` by its bare name (any
import, lazy ones inside functions included), so no test depends on another test module being importable or
collected; ``support/__init__.py`` imports nothing; the scripts a test starts by name exist."""
import ast
import re
from pathlib import Path

import support

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"
#: what a test calls to start a script of support/scripts by its name (support/processes.py)
LAUNCHERS = ("run_script", "run_two_ranks", "run_ranks", "script")


def _suite_modules() -> list:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> list:
    """(line, module) of every import in ``path``; ``from a import b`` also yields ``a.b`` (b may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):  # a relative import: only inside the support package
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_support_is_this_trees_package_and_imports_nothing():
    assert Path(support.__file__).resolve() == SUPPORT / "__init__.py"
    assert _imported(SUPPORT / "__init__.py") == []


def test_outside_support_there_are_only_test_modules_and_conftests():
    loose = [str(p.relative_to(TESTS)) for p in _suite_modules()
             if SUPPORT not in p.parents and not (p.name.startswith("test_") or p.name == "conftest.py")]
    assert not loose, f"helpers belong in tests/support/: {loose}"


def test_no_module_of_the_suite_imports_a_test_module_or_a_helper_outside_support():
    test_modules = {p.stem for p in _suite_modules() if SUPPORT not in p.parents}  # test_*, conftest
    support_modules = {p.stem for p in SUPPORT.rglob("*.py")} | {"scripts"}
    offending = []
    for path in _suite_modules():
        for line, name in _imported(path):
            top = name.split(".")[0]
            if (top in test_modules or top in ("tests", "conftest") or top in support_modules
                    or name.startswith(".")):
                offending.append(f"{path.relative_to(TESTS)}:{line}: {name}")
    assert not offending, "import helpers as support.<module>; never a test module:\n" + "\n".join(offending)


def test_every_script_a_test_starts_exists():
    started = set()
    for path in _suite_modules():
        text = path.read_text()
        started.update(re.findall(rf"\b(?:{'|'.join(LAUNCHERS)})\(\s*\"(\w+)\"", text))
    assert started >= {"precision_ddp", "fsdp2", "dtensor", "torchtitan_tp"}  # the search finds the launches
    missing = sorted(name for name in started if not (SUPPORT / "scripts" / f"{name}.py").is_file())
    assert not missing, f"no support/scripts/<name>.py for {missing}"
