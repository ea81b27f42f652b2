"""The step path reads no device flag on the host after warm-up (O1/O2/O3, static and dynamic scaling)."""
import logging
import os
import sys
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_amp import AmpPrecision
from lightning_amp.optimizers import FusedAdam

_PACKAGE = os.path.dirname(sys.modules["lightning_amp"].__file__)
_READS = ("item", "__bool__", "__float__", "__int__", "cpu", "tolist", "numpy")


class _Net(L.LightningModule):
    def __init__(self, optimizer):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).float().square().mean()

    def configure_optimizers(self):
        opt = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3), "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
               "fused": lambda p: FusedAdam(p, lr=1e-3)}[self.optimizer](self.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _inside_package(frame) -> bool:
    """Whether lightning_amp code is anywhere on the stack of ``frame`` (our step, or code it calls:
    torch, Lightning or the user's hooks and closure)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            return True
        frame = frame.f_back
    return False


class _NoReads(L.Callback):
    """From step ``after`` on, record every host read of a tensor made while lightning_amp code runs,
    by any caller (a read inside torch or Lightning code called from our step counts too)."""

    def __init__(self, after=2):
        self.after, self.calls, self._saved = after, [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step < self.after or self._saved:
            return
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def spy(tensor, *args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1)
                if _inside_package(caller):
                    self.calls.append(f"{_name} from {caller.f_code.co_filename}:{caller.f_lineno}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, spy)

    def restore(self):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}


@pytest.mark.parametrize("level, dtype, optimizer", [
    ("O1", "float16", "adamw"), ("O1", "bfloat16", "sgd"), ("O2", "float16", "adamw"), ("O2", "bfloat16", "sgd"),
    ("O2", "float16", "fused"), ("O3", "bfloat16", "adamw"), ("O3", "float16", "fused"),
])
def test_no_host_read_of_device_flags_after_warmup(level, dtype, optimizer):
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    spy = _NoReads()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, plugins=[AmpPrecision(level, dtype=dtype)], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[spy])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(_Net(optimizer), data)
        finally:
            spy.restore()
    assert spy._saved == {} and trainer.global_step == 6
    assert spy.calls == []
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 6  # every clean step advanced it


def test_the_spy_sees_a_host_read():
    """The check above can fail: the host driver (an optimizer without the protocol) reads the flag."""
    class _Rms(_Net):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    spy = _NoReads()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, plugins=[AmpPrecision("O2", dtype="float16")], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[spy])
    try:
        trainer.fit(_Rms("adamw"), data)
    finally:
        spy.restore()
    assert any(call.startswith("__bool__") or call.startswith("item") for call in spy.calls)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("level, dtype, optimizer", [("O2", "float16", "adamw"), ("O2", "bfloat16", "fused"),
                                                     ("O1", "float16", "sgd"), ("O3", "bfloat16", "adamw")])
def test_cuda_steps_make_no_synchronising_call(level, dtype, optimizer):
    class _Guard(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= 2:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("default")

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=6, plugins=[AmpPrecision(level, dtype=dtype)],
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[_Guard()])
    try:
        trainer.fit(_Net(optimizer), data)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.global_step == 6
