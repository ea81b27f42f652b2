"""The multi-tensor operators called with DTensors go through DTensor's dispatch (lightning_amp/ops/_dtensor.py):
on a 1-rank mesh (this process) and on 2 gloo CPU ranks, each op equals the op on the full tensors with its
placements kept, the reduced outputs (norms, flags, LAMB's squared norms) reduce to those of the whole tensors,
and FusedAdam/FusedSGD/FusedLAMB on a ``fully_shard`` model step as on the unsharded model; the compiled path
never unwraps by hand (``ops.local_shards`` fails if called). The checks are in support/dtensor_checks.py.
"""
import pytest
import torch
import torch.distributed as dist

from lightning_amp import ops
from support.processes import free_port, run_script

pytestmark = pytest.mark.skipif(ops._ext_for("cpu") is None,
                                reason=f"compiled extension not loaded: {ops.extension_error()}")


def test_ops_on_a_one_rank_mesh_equal_the_ops_on_full_tensors(monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh

    from support import dtensor_checks

    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        assert dtensor_checks.check_all(init_device_mesh("cpu", (1,))) == dtensor_checks.CHECKS
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ops_on_two_gloo_ranks_equal_the_ops_on_full_tensors(tmp_path):
    from support import dtensor_checks

    run_script("dtensor", tmp_path)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}.txt").read_text()
        assert text.splitlines() == dtensor_checks.CHECKS, f"rank {rank}:\n{text}"


def test_plain_tensors_take_the_direct_cpp_path(monkeypatch):
    """No DTensor: ``_library.run`` calls the C++ entry point, not the operator (no custom-op dispatch)."""
    from lightning_amp.ops import _library

    called = []
    monkeypatch.setattr(_library, "lamp", type("Spy", (), {"__getattr__": lambda self, n: called.append(n)})())
    params, grads = [torch.ones(4)], [torch.ones(4)]
    ops.multi_tensor_sgd(params, grads, None, lr=0.5)
    assert called == [] and torch.equal(params[0], torch.full((4,), 0.5))
