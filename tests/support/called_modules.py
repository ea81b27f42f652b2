"""``pytest --called-modules=FILE`` (tests/conftest.py): which modules of lightning_amp had a function of theirs called
in the test process while the tests ran (after collection), so that a lane (``-m "not slow"``) can be shown to
exercise every module, not merely import it (``import lightning_amp`` imports most of them). A ``sys.settrace`` hook
that records each call of a function (not a module's or a class's body, not a comprehension) defined in the package's
files and traces no line; code run only in a child process (the CLI, the GPU check's parts, the ranks of
multi-process tests) is not seen. FILE lists each module: ``called``, ``imported`` (it defines no function:
imported is all it can be), ``NOT CALLED`` or ``NOT IMPORTED``.
"""
import ast
import inspect
import sys
import threading
from pathlib import Path

import lightning_amp

PACKAGE = Path(lightning_amp.__file__).resolve().parent
_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class CalledModules:
    """The pytest plugin: traces from the end of collection to the session's end, then writes ``path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.called = set()  # resolved paths of the package's files
        self._files = {}  # a code object's file name -> its resolved path if it is the package's, else None

    def _trace(self, frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_flags & inspect.CO_OPTIMIZED and code.co_name not in _COMPREHENSIONS:
            name = code.co_filename
            if name not in self._files:
                path = Path(name).resolve() if name.endswith(".py") else None
                self._files[name] = str(path) if path and path.is_relative_to(PACKAGE) else None
            if self._files[name]:
                self.called.add(self._files[name])
        return None  # no line events

    def pytest_collection_finish(self, session):
        threading.settrace(self._trace)
        sys.settrace(self._trace)

    def pytest_sessionfinish(self, session, exitstatus):
        sys.settrace(None)
        threading.settrace(None)
        verdicts = {module_name(p): self._verdict(p) for p in sorted(PACKAGE.rglob("*.py"))}
        missing = [m for m, verdict in verdicts.items() if verdict.startswith("NOT")]
        self.path.write_text(f"{len(verdicts) - len(missing)} of {len(verdicts)} lightning_amp modules had a function "
                             f"called in the test process, or define none and were imported; not: {len(missing)}\n"
                             + "".join(f"{verdict:12}  {m}\n" for m, verdict in verdicts.items()))

    def _verdict(self, path: Path) -> str:
        if str(path) in self.called:
            return "called"
        tree = ast.parse(path.read_text())
        defines = any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for node in ast.walk(tree))
        if defines:
            return "NOT CALLED"
        return "imported" if module_name(path) in sys.modules else "NOT IMPORTED"
