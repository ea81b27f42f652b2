"""The names the plugins take for their half dtype (``dtype="fp16"``): one table for every reader.

:mod:`lightning_amp.amp.levels` maps them to torch dtypes for the plugins; ``lightning-amp bench --dtype``
takes the same names. Imports nothing of lightning-amp, torch or Lightning (the command line reads it without
importing torch, ``tests/test_import_layers.py``).
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

AUTO = "auto"
HALF_DTYPES: Mapping[str, Tuple[str, ...]] = {"float16": ("float16", "fp16", "half"), "bfloat16": ("bfloat16", "bf16")}
"""Each half dtype (its torch name) -> the names it is taken under, its own first."""
HALF_DTYPE_NAMES: Mapping[str, str] = {name: dtype for dtype, names in HALF_DTYPES.items() for name in names}
"""Every name of a half dtype -> that dtype's torch name."""
FP32_NAMES: Tuple[str, ...] = ("float32", "fp32", "float")
"""The names of float32 (O0 takes them)."""


def half_dtype(name: object) -> Optional[str]:
    """The torch name of the half dtype ``name`` names ("fp16" -> "float16", any case, blanks around ignored),
    "auto" for "auto", None for anything else."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return AUTO if key == AUTO else HALF_DTYPE_NAMES.get(key)


def half_dtype_spellings() -> str:
    """The names as a message lists them: '"float16"/"fp16"/"half", "bfloat16"/"bf16"'."""
    return ", ".join("/".join(f'"{name}"' for name in names) for names in HALF_DTYPES.values())
