"""Loading of the compiled core ``lightning_amp._C`` and the per-device choice of implementation.

Standalone (no imports from the rest of :mod:`lightning_amp.ops`): the environment switches are
read once, here, at import (see :mod:`lightning_amp.ops` for the list).
"""
from __future__ import annotations

import glob
import importlib
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

_EXT = None
_EXT_ERROR: Optional[str] = None


def _built_extension_files() -> list:
    """Compiled ``_C`` files of the package (present = built, whether or not it loads)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))


def _load_extension() -> None:
    global _EXT, _EXT_ERROR
    if os.environ.get("LIGHTNING_AMP_DISABLE_EXT") == "1":
        _EXT_ERROR = "disabled by LIGHTNING_AMP_DISABLE_EXT=1"
        return
    required = os.environ.get("LIGHTNING_AMP_REQUIRE_EXT") == "1"
    try:
        _EXT = importlib.import_module("lightning_amp._C")
    except ImportError as err:  # the package keeps working without the build, loudly
        built = _built_extension_files()
        _EXT_ERROR = (f"lightning_amp/{os.path.basename(built[0])} is built but failed to load: {err}" if built
                      else f"lightning_amp._C is not built ({err})")
        if required:
            raise ImportError(f"lightning_amp: LIGHTNING_AMP_REQUIRE_EXT=1 but {_EXT_ERROR}") from err
        warnings.warn(
            f"lightning_amp: {_EXT_ERROR}; using the pure-PyTorch fallback ops. "
            "Rebuild with `make install` (or `pip install --no-build-isolation -e .`).",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if required and not _EXT.WITH_CUDA and torch.cuda.is_available():
        raise ImportError("lightning_amp: LIGHTNING_AMP_REQUIRE_EXT=1 but lightning_amp._C was built without CUDA "
                          "kernels on a machine with a CUDA device (rebuild with nvcc on PATH / CUDA_HOME set)")


_load_extension()


def _apply_wgrad_cpu_gemm_env() -> None:
    value = os.environ.get("LIGHTNING_AMP_WGRAD_CPU_GEMM")
    if value is None or _EXT is None:
        return
    try:
        _EXT._set_wgrad_cpu_gemm_policy(value)
    except ValueError as err:
        raise ValueError(f"LIGHTNING_AMP_WGRAD_CPU_GEMM={value!r}: {err}") from None


_apply_wgrad_cpu_gemm_env()


def extension_error() -> Optional[str]:
    """Why the compiled extension is not in use, or None when it is loaded."""
    return _EXT_ERROR


def extension_path() -> Optional[str]:
    """The file the compiled extension was loaded from, or None when it is not loaded."""
    return getattr(_EXT, "__file__", None)


def extension_module():
    """The loaded compiled extension, or None (for the parts that are no per-device op: O2's autocast
    policy, :mod:`lightning_amp.amp.o2_policy`)."""
    return _EXT


def _ext_for(device: torch.device | str):
    """The extension module if it has kernels for ``device``, else None."""
    if _EXT is None:
        return None
    kind = torch.device(device).type
    if kind == "cpu":
        return _EXT
    if kind == "cuda" and getattr(_EXT, "WITH_CUDA", False):
        return _EXT
    return None


def backend(device: torch.device | str = "cpu") -> str:
    """Which implementation serves ``device``: ``"cpu-ext"``, ``"cuda-ext"`` or ``"torch"``."""
    kind = torch.device(device).type
    return f"{kind}-ext" if _ext_for(device) is not None else "torch"


def wgrad_cpu_gemm(dtype: torch.dtype) -> Optional[str]:
    """The CPU GEMM path that serves :func:`wgrad_gemm_accum_fp32` for ``dtype`` operands in this
    process: ``"onednn"``, ``"mkl"`` or ``"aten"`` (for 16-bit dtypes this runs the one-time
    measurement if it has not run yet), or None without the compiled extension."""
    if _EXT is None:
        return None
    return _EXT._wgrad_cpu_gemm_backend(str(dtype).replace("torch.", ""))


def _check_dense(op: str, name: str, t: Tensor) -> None:
    """Sparse (and other non-strided) tensors have no dense storage for the kernels to walk."""
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}")


_C10_NAMES = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
              torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble", torch.int64: "Long",
              torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}


def _c10_name(dtype: torch.dtype) -> str:
    """A dtype as the C++ checks print it (torch.float64 -> Double), for the fallbacks' matching messages."""
    return _C10_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _check_float_like(op: str, name: str, t: Tensor) -> None:
    """As csrc/checks.h ``LAMP_CHECK_FLOAT_LIKE``: dense, then float32/float16/bfloat16."""
    _check_dense(op, name, t)
    if t.dtype not in _EXT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {_c10_name(t.dtype)}")


_EXT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _ext_accepts(tensors) -> bool:
    """The multi-tensor kernels take dense contiguous fp32/fp16/bf16 tensors; others use the fallback
    (a routing rule, not an argument check: the fallback checks and refuses what nothing can run)."""
    return all(isinstance(t, Tensor) and t.layout == torch.strided and t.dtype in _EXT_DTYPES and t.is_contiguous()
               for t in tensors)
