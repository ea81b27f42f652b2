"""Optional test dependencies: skipped where absent (the GPU machine has no network), required in CI.

:func:`require` is ``pytest.importorskip`` except under ``CI=true`` (GitHub Actions, most CI services),
where a missing package fails the test: a broken install must not silently skip what it should test.
"""
import importlib
import os

import pytest


def require(module: str):
    """The imported ``module``; a skip when it is missing, a failure when it is missing under ``CI=true``."""
    if os.environ.get("CI", "").lower() == "true":
        try:
            return importlib.import_module(module)
        except ImportError as error:
            pytest.fail(f"CI=true and the test dependency {module!r} is not importable ({error}); "
                        "install the dev extras: pip install -e '.[dev]'", pytrace=False)
    return pytest.importorskip(module)
