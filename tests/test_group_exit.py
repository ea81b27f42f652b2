"""lightning_amp/group_exit.py: a plugin of ours set up where a gloo process group exists registers the destroy of the
groups at exit (Lightning does it for NCCL only; a gloo group left to Python's finalization can abort a finished rank).

The abort itself is a race at exit (torch's gloo worker thread against the finalizing interpreter; measured in
benchmarks/RESULTS.md, "Issue 48 (2026-11-29, session 2)"); these tests check the registration that removes it, in
this process, on a one-rank gloo group."""
import atexit

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_amp import AmpPrecision, group_exit
from lightning_amp.fabric import FabricAmpPrecision
from support.trainer import quiet_lightning


@pytest.fixture
def registered(monkeypatch):
    """The exit handlers registered through group_exit during the test (none is really registered)."""
    handlers = []
    monkeypatch.setattr(group_exit.atexit, "register", handlers.append)
    monkeypatch.setattr(group_exit.atexit, "unregister", lambda fn: handlers.remove(fn) if fn in handlers else None)
    return handlers


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fabric_setup(opt_level="O1"):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricAmpPrecision(opt_level=opt_level)])
    model = torch.nn.Linear(4, 2)
    fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _trainer_fit():
    trainer = L.Trainer(accelerator="cpu", max_steps=1, plugins=[AmpPrecision("O1", dtype="bfloat16")], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with quiet_lightning():
        trainer.fit(BoringModel())


@pytest.mark.parametrize("setup", [_fabric_setup, _trainer_fit], ids=["fabric", "trainer"])
def test_a_plugin_set_up_beside_a_gloo_group_destroys_it_at_exit(setup, registered, gloo_group):
    setup()
    assert registered == [_destroy_dist_connection]
    setup()  # registered once however many runs
    assert registered == [_destroy_dist_connection]
    registered[0]()  # what the interpreter runs at exit
    assert not dist.is_initialized()


def test_without_a_group_nothing_is_registered(registered):
    assert not dist.is_initialized()
    _fabric_setup()
    _trainer_fit()
    assert registered == []


def test_the_handler_is_lightnings_and_atexit_runs_it():
    """What is registered is Lightning's NCCL handler itself (a no-op once the group is gone), by atexit's own
    register: the registration above is the real one."""
    assert group_exit.atexit is atexit and group_exit._destroy_dist_connection is _destroy_dist_connection
    _destroy_dist_connection()  # no group: nothing to do, no error
