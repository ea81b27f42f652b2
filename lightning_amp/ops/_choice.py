"""Per device and dtype, the faster of our compiled kernel and torch's own for the ops torch also ships.

torch has fused Adam/AdamW (``torch._fused_adam_`` / ``_fused_adamw_``) and SGD (``torch._fused_sgd_``)
kernels on the CPU and CUDA, and ``torch._foreach_norm``; where one of them beats our kernel on the
same tensors (``benchmarks/bench_optim.py``, ours/torch in time, both in one run), :mod:`.optim` and
:mod:`.multi_tensor` call it instead, with our semantics kept by the callers (grads written back
unscaled, a set ``found_inf`` changing nothing, no host read). The table below is measured, not
guessed (benchmarks/RESULTS.md, "Issue 49"):

* CPU: Intel Xeon with AVX-512 (no AVX512_BF16, no AMX), torch 2.13, ``bench_optim.py --clock cpu --threads 1``
  (CPU time of one thread: the machine was shared with builds, load average 9; wall times there swung 4x),
  our kernel / our op through torch's kernel, ms, few large tensors (4 x 1M) and many small (10,000 x
  1-4k): Adam fp32 6.42 / 6.56 and 81.9 / 118.1 (ours); SGD fp32 5.23 / 4.97 and 74.3 / 59.3 (torch's); L2
  norm fp32 1.20 / 1.59 and 20.3 / 68.5, bf16 1.03 / 6.06 and 18.1 / 84.7 (ours); Adam bf16, since our
  16-bit conversions went one vector at a time (issue 49, session 2), 4.36 / 4.66 and 55.6 / 72.7 (ours;
  10.11 / 4.79 and 95.6 / 85.4 before). Not measured, so ours: float16. No size class changes a CPU row's
  winner.
* CUDA, H200 (benchmarks/gpu/f667cf8, few large tensors): torch's fused AdamW 0.146 / 0.118 ms against
  our 0.209 / 0.211 ms (fp32 / bf16), ``_foreach_norm`` 0.078 / 0.076 ms against our l2norm's 0.130 /
  0.132; our ``multi_tensor_scale`` is 2x torch's chain and stays. Not measured there, taken from those
  rows: float16 (the same 16-bit loads as bf16 in both kernels) and SGD (torch's kernel is the AdamW
  kernel's machinery, ``multi_tensor_apply`` with the same vector width; ours shares the machinery that
  reached 68% of copy bandwidth); a GPU check is to confirm them.

Where torch's kernel cannot keep our semantics the callers keep ours whatever the table says (16-bit
params on the CPU for SGD, a torch bug; 16-bit params with momentum on CUDA; grads of another dtype
than the params; fp32 master weights with 16-bit model copies, which our kernel writes in the same
pass; Adam without bias correction; DTensors; a ``torch.compile`` trace).
"""
from __future__ import annotations

from typing import Optional

import torch

OURS, TORCH = "ours", "torch"

# (op, device type) -> {param dtype: implementation}; an op, device or dtype not listed: ours.
TABLE = {
    ("sgd", "cpu"): {torch.float32: TORCH},
    ("adam", "cuda"): {torch.float32: TORCH, torch.bfloat16: TORCH, torch.float16: TORCH},
    ("sgd", "cuda"): {torch.float32: TORCH, torch.bfloat16: TORCH, torch.float16: TORCH},
    ("l2norm", "cuda"): {torch.float32: TORCH, torch.bfloat16: TORCH, torch.float16: TORCH},
}

#: tests set this to OURS or TORCH to run one implementation wherever both can serve (None: the table)
forced: Optional[str] = None


def prefers_torch(op: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's kernel serves ``op`` for tensors of ``dtype`` on ``device`` (where it can keep our
    semantics: the caller checks that)."""
    if forced is not None:
        return forced == TORCH
    return TABLE.get((op, device.type), {}).get(dtype) == TORCH
