"""Destroy the default process group at exit when its backend is not NCCL: what Lightning does for NCCL only.

A gloo group left to Python's finalization can abort a rank that finished its work (SIGABRT, "terminate called
without an active exception"): torch's gloo worker thread (``pt_gloo_runloop``, ``ProcessGroupGloo::runLoop``) drops
the last reference to a finished collective, whose tensors release their Python objects under the GIL; a
finalizing Python ends such a thread instead of handing it the GIL (``pthread_exit``), and the forced unwind through
the work's ``noexcept`` destructor calls ``std::terminate``. Plain torch does it too (2 spawned ranks, ten
all-reduces, no ``destroy_process_group``: 9 of 36 runs lost a rank here, 0 of 36 with it; benchmarks/RESULTS.md,
"Issue 48 (2026-11-29, session 2)"). Our Trainer and Fabric plugins and ``tp_fused`` call
:func:`destroy_group_at_exit` once a group exists (a plugin when it casts the model, the strategy when it built its
groups), so a run under Lightning's DDP/``ddp_spawn``/FSDP2 strategies on the CPU exits cleanly with a plugin of ours.

The handler is Lightning's own ``_destroy_dist_connection`` (a no-op when the group is gone), registered once per
process and left until the interpreter exits (docs/architecture.md, "Process-wide state": set once by design).
"""
from __future__ import annotations

import atexit

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection


def destroy_group_at_exit() -> None:
    """Register the destroy of every process group at exit when a non-NCCL default group exists (registered once:
    a later call moves it, Lightning's NCCL registration included, to run first)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "nccl":
        atexit.unregister(_destroy_dist_connection)
        atexit.register(_destroy_dist_connection)
