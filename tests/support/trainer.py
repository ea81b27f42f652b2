"""Helpers shared by the tests that train through a real Lightning Trainer."""
import contextlib
import logging
import warnings
from typing import Iterator, List

import lightning as L
import torch


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's info logging and all warnings silenced inside the block."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class LossRecorder(L.Callback):
    """Collects the loss of every training batch as a float, in order, in ``losses``."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


class DestroyGroupAtTeardown(L.Callback):
    """Destroys the process group of a run under one of Lightning's own DDP strategies on gloo when the Trainer's
    teardown hooks run (after the strategy's teardown, the last collective): Lightning destroys a group at exit for
    NCCL only, and a spawned rank that leaves a gloo group to Python's finalization can abort after its work is done
    (SIGABRT, see :mod:`support.scripts`). Not for ``tp_fused``, whose launcher still gathers after teardown and
    destroys its groups itself."""

    def teardown(self, trainer, pl_module, stage):
        if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
            torch.distributed.destroy_process_group()


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Every entry of ``got``'s state dict equals ``want``'s, in order, bit for bit."""
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        assert torch.equal(a, b), name
