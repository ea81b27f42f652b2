"""Loading of the compiled core ``lightning_amp._C`` and the per-device choice of implementation.

Standalone (no imports from the rest of :mod:`lightning_amp.ops` but :mod:`._build`): the environment
switches are read once, here, at import (see :mod:`lightning_amp.ops` for the list).

Where the extension comes from, first match wins:

1. **prebuilt**: ``lightning_amp/_C*.so``, built by ``setup.py`` against an importable torch (``make
   install``, ``pip install --no-build-isolation``, a wheel built that way). Its record
   ``_C.build.json`` must name the running torch, CUDA version, C++ ABI and Python; a mismatch is not
   loaded (an extension built for another torch fails with undefined symbols, or worse). Nor is one
   built from other sources than those shipped beside it (a source tree pulled after ``make install``:
   its kernels would be stale). Without a record (a copied file) it is loaded if it loads.
2. **cached**: a first-use build for this torch, machine and sources in the per-user cache
   (:mod:`._build`), compiled now if there is none (unless ``LIGHTNING_AMP_NO_BUILD=1``).
3. otherwise the pure-PyTorch fallbacks, with a RuntimeWarning giving every reason.
"""
from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import sys
import warnings
from typing import Optional

import torch
from torch import Tensor

from . import _build, _wgrad_choice

_EXT = None
_EXT_ERROR: Optional[str] = None
_EXT_ORIGIN: Optional[str] = None


def _built_extension_files() -> list:
    """Compiled ``_C`` files of the package (present = built, whether or not it loads)."""
    here = _build.PACKAGE_DIR
    return sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))


def _describe_identity(identity: dict) -> str:
    cuda = f"CUDA {identity.get('cuda')}" if identity.get("cuda") else "no CUDA"
    return f"torch {identity.get('torch')} ({cuda}, C++11 ABI {identity.get('cxx11_abi')}, {identity.get('python')})"


def _prebuilt_record() -> Optional[dict]:
    """The record setup.py wrote beside the prebuilt extension (what it was built for), or None."""
    try:
        with open(os.path.join(_build.PACKAGE_DIR, _build.BUILD_RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load_prebuilt():
    """(module, None, origin) or (None, why not, None)."""
    built = _built_extension_files()
    record = _prebuilt_record() if built else None
    if record is not None:
        here = _build.runtime_identity()
        if {k: record.get(k) for k in here} != here:
            return None, (f"lightning_amp/{os.path.basename(built[0])} was built for {_describe_identity(record)}, "
                          f"this is {_describe_identity(here)}"), None
        root = _build.source_dir()
        if root is not None and record.get("sources") != _build.sources_digest(root):
            return None, (f"lightning_amp/{os.path.basename(built[0])} was built from other sources than those in "
                          f"{root} (rebuild it: `make install` or `pip install --no-build-isolation -e .`)"), None
    if not built:
        return None, f"lightning_amp._C is not built (no _C*.so in {_build.PACKAGE_DIR})", None
    try:
        # By path: another installation's finder (an editable install elsewhere) must not answer for this package.
        module = (importlib.import_module("lightning_amp._C") if "lightning_amp._C" in sys.modules
                  else _import_library(built[0]))
    except ImportError as err:
        return None, f"lightning_amp/{os.path.basename(built[0])} is built but failed to load: {err}", None
    origin = ("prebuilt by setup.py for this torch" if record is not None
              else f"prebuilt, no {_build.BUILD_RECORD} beside it: loaded as found")
    return module, None, origin


def _import_library(path: str):
    """The extension module in ``path`` imported as ``lightning_amp._C``."""
    spec = importlib.util.spec_from_file_location("lightning_amp._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["lightning_amp._C"] = module
    return module


def _load_cached():
    """(module, None) or (None, why not): the first-use build for this torch and machine, built now if needed."""
    try:
        root = _build.require_source_dir()
        key = _build.build_key(root)
        library = _build.find_build(key)
        if library is None:
            if os.environ.get("LIGHTNING_AMP_NO_BUILD") == "1":
                return None, (f"no cached build for {_build.describe(key)} in {' or '.join(_build.cache_roots())} "
                              f"(key {key.name}) and LIGHTNING_AMP_NO_BUILD=1")
            library = _build.build_here(root, key).library
    except (_build.BuildError, OSError) as err:
        return None, str(err)
    try:
        return _import_library(library), None
    except ImportError as err:
        return None, f"the cached build {library} failed to load ({err}); delete its folder to rebuild"


def _load_extension() -> None:
    global _EXT, _EXT_ERROR, _EXT_ORIGIN
    if os.environ.get("LIGHTNING_AMP_DISABLE_EXT") == "1":
        _EXT_ERROR = "disabled by LIGHTNING_AMP_DISABLE_EXT=1"
        return
    required = os.environ.get("LIGHTNING_AMP_REQUIRE_EXT") == "1"
    module, prebuilt_error, origin = _load_prebuilt()
    cached_error = None
    if module is None:
        module, cached_error = _load_cached()
        origin = "first-use build from the per-user cache"
    if module is None:  # the package keeps working without the build, loudly
        _EXT_ERROR = f"{prebuilt_error}; {cached_error}"
        if required:
            raise ImportError(f"lightning_amp: LIGHTNING_AMP_REQUIRE_EXT=1 but {_EXT_ERROR}")
        warnings.warn(
            f"lightning_amp: {_EXT_ERROR}; using the pure-PyTorch fallback ops. "
            "Build ahead with `lightning-amp build`, or in place with `make install` in a clone.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    _EXT, _EXT_ORIGIN = module, origin
    if required and not _EXT.WITH_CUDA and torch.cuda.is_available():
        raise ImportError("lightning_amp: LIGHTNING_AMP_REQUIRE_EXT=1 but lightning_amp._C was built without CUDA "
                          "kernels on a machine with a CUDA device (rebuild with nvcc on PATH / CUDA_HOME set)")


_load_extension()


_WGRAD_CPU_GEMM_POLICY = "auto"  # LIGHTNING_AMP_WGRAD_CPU_GEMM as applied at import


def _apply_wgrad_cpu_gemm_env() -> None:
    global _WGRAD_CPU_GEMM_POLICY
    value = os.environ.get("LIGHTNING_AMP_WGRAD_CPU_GEMM")
    if value is None or _EXT is None:
        return
    try:
        _EXT._set_wgrad_cpu_gemm_policy(value)
    except ValueError as err:
        raise ValueError(f"LIGHTNING_AMP_WGRAD_CPU_GEMM={value!r}: {err}") from None
    _WGRAD_CPU_GEMM_POLICY = value


_apply_wgrad_cpu_gemm_env()


def extension_error() -> Optional[str]:
    """Why the compiled extension is not in use, or None when it is loaded."""
    return _EXT_ERROR


def extension_path() -> Optional[str]:
    """The file the compiled extension was loaded from, or None when it is not loaded."""
    return getattr(_EXT, "__file__", None)


def extension_origin() -> Optional[str]:
    """Which kind of build loaded (prebuilt by setup.py, or a first-use build from the cache), or None."""
    return _EXT_ORIGIN if _EXT is not None else None


def extension_module():
    """The loaded compiled extension, or None (for the parts that are no per-device op: O2's autocast
    policy, :mod:`lightning_amp.amp.o2.policy`)."""
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


def _decide_wgrad_cpu_gemm(dtype) -> None:
    """Before the first CPU wgrad GEMM of 16-bit ``dtype`` under the "auto" policy: the machine's measured
    path from the cache beside the build (:mod:`._wgrad_choice`), measured now if it has none."""
    if _EXT is not None and _WGRAD_CPU_GEMM_POLICY == "auto":
        _wgrad_choice.ensure(_EXT, dtype)


def wgrad_cpu_gemm(dtype: torch.dtype) -> Optional[str]:
    """The CPU GEMM path that serves :func:`wgrad_gemm_accum_fp32` for ``dtype`` operands in this
    process: ``"onednn"``, ``"mkl"`` or ``"aten"`` (the machine's measured choice under "auto", measured
    now if this machine has none cached; under ``LIGHTNING_AMP_WGRAD_CPU_GEMM=fastest`` the per-process
    measurement), or None without the compiled extension."""
    if _EXT is None:
        return None
    _decide_wgrad_cpu_gemm(dtype)
    return _EXT._wgrad_cpu_gemm_backend(str(dtype).replace("torch.", ""))


def wgrad_cpu_gemm_origin(dtype: torch.dtype) -> Optional[str]:
    """How :func:`wgrad_cpu_gemm`'s answer was decided: measured on this machine (with the times and
    the cache file), the CPU's rule (and why the cache could not be used), or the policy that pins it;
    None without the compiled extension."""
    if _EXT is None:
        return None
    if _WGRAD_CPU_GEMM_POLICY != "auto":
        return f"LIGHTNING_AMP_WGRAD_CPU_GEMM={_WGRAD_CPU_GEMM_POLICY}"
    _decide_wgrad_cpu_gemm(dtype)
    return _wgrad_choice.status(dtype) or "float32 operands always take the fp32 GEMM"


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
