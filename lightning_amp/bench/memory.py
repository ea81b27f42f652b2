"""Peak-memory probes for one benchmark process.

CPU: the process's peak resident set size (``VmHWM``) minus its resident size just before the model
was built; the kernel's high-water mark is reset at that moment (``/proc/self/clear_refs``), with
``resource.getrusage`` as the fallback where /proc is not available. GPU: ``torch.cuda.max_memory_allocated``.
All figures are in MiB.
"""
from __future__ import annotations

import gc
import resource
import sys
from typing import Optional

import torch

_MIB = 1024.0 * 1024.0


def _proc_status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (e.g. "VmRSS", "VmHWM"), or None where unavailable."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _ru_maxrss_mib() -> float:
    """Lifetime peak RSS from getrusage (KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / 1024.0


class PeakMemory:
    """Measures the extra peak memory of the work done between :meth:`start` and :meth:`peak_mib`.

    ``device_type`` is "cpu" (resident set size) or "cuda" (torch's allocator, all memory it holds).
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.baseline_mib = 0.0
        self._hwm_reset = False

    def start(self) -> None:
        """Record the baseline (call just before building the model)."""
        gc.collect()
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # reset VmHWM to the current RSS
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        rss = _proc_status_kib("VmRSS")
        self.baseline_mib = rss / 1024.0 if rss is not None else _ru_maxrss_mib()

    def peak_mib(self) -> float:
        """Peak memory since :meth:`start`, in MiB (never negative)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / _MIB
        hwm = _proc_status_kib("VmHWM") if self._hwm_reset else None
        peak = hwm / 1024.0 if hwm is not None else _ru_maxrss_mib()
        return max(0.0, peak - self.baseline_mib)
