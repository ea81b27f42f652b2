"""Optional test dependencies: skipped where absent (the GPU machine has no network), required in CI.

Under ``CI=true`` (GitHub Actions, most CI services) a missing package fails instead of skipping: a broken
install must not silently skip what it should test. :func:`require` is ``pytest.importorskip`` with that rule;
:func:`available` is the same rule for tests/test_docs.py's ``# needs:`` lines.
"""
import importlib
import importlib.util
import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def available(module: str) -> bool:
    """Whether a test needing ``module`` should run: it is installed, or this is CI (where it must be)."""
    return in_ci() or importlib.util.find_spec(module) is not None


def require(module: str):
    """The imported ``module``; a skip when it is missing, a failure when it is missing under ``CI=true``."""
    if in_ci():
        try:
            return importlib.import_module(module)
        except ImportError as error:
            pytest.fail(f"CI=true and the test dependency {module!r} is not importable ({error}); "
                        "make install (pip install --no-deps litgpt==0.5.13 for litgpt)", pytrace=False)
    return pytest.importorskip(module)
