"""The torch releases lightning-amp is tested with, and the one warning a user of another release gets.

``TORCH_REQUIREMENT`` is the ``torch`` dependency of ``pyproject.toml`` (``tests/test_torch_support.py`` checks
that they are the same string); CI builds and runs under its oldest and newest releases (``.ci/torch-releases``).
A torch outside it is not refused (it may work, and pip must not replace a user's torch to install this
package): :func:`warn_if_untested` warns once, at import, naming the range.
"""
import re
import warnings
from typing import Optional, Tuple

TORCH_REQUIREMENT = ">=2.11,<2.16"

Release = Tuple[int, int]


def _bounds() -> Tuple[Release, Release]:
    lo_major, lo_minor, hi_major, hi_minor = map(int, re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)",
                                                                  TORCH_REQUIREMENT).groups())
    return (lo_major, lo_minor), (hi_major, hi_minor)


def release(version: str) -> Optional[Release]:
    """(major, minor) of a torch version string ("2.14.1+cu130" -> (2, 14)); None when it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def tested(version: str) -> bool:
    """Whether torch ``version`` lies in :data:`TORCH_REQUIREMENT` (a version without a release number: no)."""
    low, high = _bounds()
    found = release(version)
    return found is not None and low <= found < high


def warn_if_untested(version: str) -> bool:
    """Warn (a ``UserWarning``) when torch ``version`` is outside :data:`TORCH_REQUIREMENT`; True if it warned."""
    if tested(version):
        return False
    warnings.warn(f"lightning-amp is tested with torch{TORCH_REQUIREMENT}; this is torch {version}. It may work; "
                  f"if it does not, install a torch in that range (pip install 'torch{TORCH_REQUIREMENT}').",
                  UserWarning, stacklevel=2)
    return True
