"""The CPU wgrad GEMM path of this machine: measured once per machine, cached beside the build.

The 16-bit CPU paths of :func:`lightning_amp.ops.wgrad_gemm_accum_fp32` (``onednn``, ``mkl``, ``aten``,
csrc/cpu/wgrad_gemm.cpp) give the same numerics but sum in different orders, so every process and rank
of a job, and a resumed run, must take the same one; which is fastest differs by a factor of 3-4 from
one CPU to the next (MKL's 16-bit GEMM off Intel, oneDNN's micro-kernel without AMX). Under the default
policy (``LIGHTNING_AMP_WGRAD_CPU_GEMM`` unset or ``auto``) the first 16-bit call of a process:

1. reads ``_C.wgrad_cpu_gemm.json`` beside the loaded extension (:func:`cache_path`): a whole entry for
   this machine (:func:`machine_key`: the CPU's model and vector flags, the libraries' ISA caps, torch)
   and dtype is taken as it is;
2. else, under an ``fcntl`` lock on ``<cache>.lock``, reads it again (another process may have measured
   meanwhile), else measures the usable paths once (the extension's calibration: a 2048 x 1024 x 1024
   product, warm-up then the fastest of three interleaved rounds, with oneDNN switched on) and writes the
   ranking (a temporary file renamed over the cache, so a reader never sees half a file);
3. hands the fastest path to the extension, which takes it while it is usable (oneDNN switched off
   falls back to the rule). Where the cache can be neither read nor written, the extension's rule of the
   CPU decides (the same answer in every process): :func:`status` says which happened.

Threads of one process deciding at once wait on the same lock (each opens the lock file itself, and
``flock`` locks are per open file), so the second reads what the first wrote.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
from typing import Optional

import torch

from . import _build

CACHE_NAME = "_C.wgrad_cpu_gemm.json"
_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
          "avx_vnni", "amx_tile", "amx_bf16", "amx_fp16")
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

_decided: dict = {}  # dtype name -> the status line of its decision in this process


def cache_path(ext) -> str:
    """Where the machine's choice is cached: beside the loaded extension (the build it measured)."""
    return os.path.join(os.path.dirname(os.path.abspath(ext.__file__)), CACHE_NAME)


def machine_key() -> str:
    """What the choice depends on: CPU model and vector flags, the ISA caps of oneDNN / MKL / ATen set in
    the environment, torch's version and the machine's architecture (not the thread count: every process
    of a machine must agree)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    caps = {k: os.environ[k] for k in _ISA_CAPS if k in os.environ}
    fields = {"cpu": model, "arch": platform.machine(), "flags": sorted(f for f in _FLAGS if f in flags),
              "caps": caps, "torch": torch.__version__}
    return json.dumps(fields, sort_keys=True)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _entry(data: dict, key: str, dtype_name: str) -> Optional[dict]:
    entry = data.get(key, {}).get(dtype_name)
    return entry if isinstance(entry, dict) and isinstance(entry.get("path"), str) else None


def _measure(ext, dtype_name: str) -> dict:
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True  # measure every path the CPU has, whatever the caller set
    try:
        ranked = ext._wgrad_cpu_gemm_calibration(dtype_name)
    finally:
        torch.backends.mkldnn.enabled = enabled
    return {"path": ranked[0][0], "ms": {p: round(s * 1e3, 3) for p, s in ranked},
            "threads": torch.get_num_threads(),
            "measured": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC"}


def _write(path: str, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=CACHE_NAME + ".", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def choose(ext, dtype_name: str) -> str:
    """The machine's path for 16-bit ``dtype_name`` from the cache, measured and written now when missing,
    handed to ``ext``; returns a status line. A cache that cannot be read or written leaves the rule."""
    path = cache_path(ext)
    key = machine_key()
    entry = _entry(_read(path), key, dtype_name)
    measured = False
    if entry is None:
        try:
            with _build.file_lock(path + ".lock", lambda: None):
                data = _read(path)
                entry = _entry(data, key, dtype_name)
                if entry is None:
                    entry = _measure(ext, dtype_name)
                    data.setdefault(key, {})[dtype_name] = entry
                    _write(path, data)
                    measured = True
        except OSError as err:
            ext._set_wgrad_cpu_gemm_choice(dtype_name, "")
            return f"the CPU's rule ({path} cannot be written: {type(err).__name__}: {err})"
    try:
        ext._set_wgrad_cpu_gemm_choice(dtype_name, entry["path"])
    except ValueError:  # a cache written by another version naming a path this one lacks
        ext._set_wgrad_cpu_gemm_choice(dtype_name, "")
        return f"the CPU's rule ({path} names an unknown path {entry['path']!r})"
    times = ", ".join(f"{p} {ms:.2f} ms" for p, ms in entry.get("ms", {}).items())
    return f"measured on this machine{' now' if measured else ''} ({times}; cache {path})"


def ensure(ext, dtype: torch.dtype) -> None:
    """Decide the path of 16-bit ``dtype`` once per process (a dict lookup after the first call)."""
    name = _DTYPES.get(dtype)
    if name is None or name in _decided:
        return
    _decided[name] = choose(ext, name)


def status(dtype: torch.dtype) -> Optional[str]:
    """How this process's path for ``dtype`` was decided (None: not yet, or not a 16-bit dtype)."""
    return _decided.get(_DTYPES.get(dtype))


def forget() -> None:
    """Drop this process's decisions (tests): the next 16-bit call decides again."""
    _decided.clear()
