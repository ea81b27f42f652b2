"""Standalone run for tests/ops/test_ops_dtensor.py: :mod:`support.dtensor_checks` on 2 gloo CPU ranks.

Usage: python -m support.scripts.dtensor OUT_DIR   (starts 2 processes itself; each writes OUT_DIR/rank<N>.txt, the names
of the checks that passed on it, or the traceback)
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from support import dtensor_checks

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        done = dtensor_checks.check_all(init_device_mesh("cpu", (2,)))
        text = "\n".join(done)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
        text = "FAILED\n" + traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(text)
    dist.barrier()  # every rank's traffic is done before either tears its gloo group down (see support.processes)
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.processes import free_port

    mp.start_processes(_worker, args=(free_port(), sys.argv[1]), nprocs=2, start_method="spawn")
