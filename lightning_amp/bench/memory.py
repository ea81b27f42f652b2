"""Peak-memory probes for one benchmark process.

CPU: the process's peak resident set size (``VmHWM``) minus its resident size just before the model
was built; the kernel's high-water mark is reset at that moment (``/proc/self/clear_refs``). Where that
reset is refused or /proc is missing, the fallback is the *lifetime* peak (``getrusage`` ``ru_maxrss``)
minus the baseline, which also counts whatever peaked before :meth:`PeakMemory.start`. GPU:
``torch.cuda.max_memory_allocated`` minus what was allocated at :meth:`PeakMemory.start`.
:attr:`PeakMemory.method` names the method that measured, and :attr:`PeakMemory.clamped` says whether a
negative difference was reported as 0; both go into ``bench.json``. All figures are in MiB.
"""
from __future__ import annotations

import gc
import resource
import sys
from typing import Optional

import torch

_MIB = 1024.0 * 1024.0
#: the values of :attr:`PeakMemory.method`
METHODS = ("cuda_max_memory_allocated", "proc_vmhwm_reset", "ru_maxrss_lifetime")


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

    ``device_type`` is "cpu" (resident set size) or "cuda" (torch's allocator, tensors allocated).
    After :meth:`peak_mib`, ``method`` is one of :data:`METHODS` and ``clamped`` is True when the
    measured difference was negative and 0 was reported instead.
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.baseline_mib = 0.0
        self.method: Optional[str] = None
        self.clamped = False
        self._hwm_reset = False

    def start(self) -> None:
        """Record the baseline (call just before building the model)."""
        gc.collect()
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline_mib = torch.cuda.memory_allocated() / _MIB
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
        """Peak memory since :meth:`start`, in MiB (never negative; see ``clamped``)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self.method = "cuda_max_memory_allocated"
            peak = torch.cuda.max_memory_allocated() / _MIB
        else:
            hwm = _proc_status_kib("VmHWM") if self._hwm_reset else None
            self.method = "proc_vmhwm_reset" if hwm is not None else "ru_maxrss_lifetime"
            peak = hwm / 1024.0 if hwm is not None else _ru_maxrss_mib()
        extra = peak - self.baseline_mib
        self.clamped = extra < 0
        return max(0.0, extra)
