"""What a child process the tests start runs as its main module, ``python -m support.scripts.<name> ARGS``
(:func:`support.processes.script`): one rank of a job started as torchrun would, or one process that starts its
ranks itself (Lightning's launcher and multiprocessing's spawn start the others the same way, with ``-m``). A test
may import one to run the same code in its own process (the one-process reference). Not test modules.

Every process that imports this package destroys its process groups at exit, before Python finalizes: Lightning does
that for NCCL only, and a gloo group left to finalization can abort a rank that finished its work (SIGABRT,
"terminate called without an active exception": torch's gloo worker thread ``pt_gloo_runloop`` drops the last
reference to a finished collective's tensors, which needs the GIL that a finalizing Python no longer hands out;
benchmarks/RESULTS.md, "Issue 48 (2026-11-29, session 2)")."""
import atexit

import torch.distributed as dist


def _destroy_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_destroy_process_groups)
