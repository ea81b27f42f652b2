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


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Every entry of ``got``'s state dict equals ``want``'s, in order, bit for bit."""
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        assert torch.equal(a, b), name
