"""An exception inside an O2 forward switches O2's op policy off on that thread again (issue 35).

O2's rules apply on the threads that entered O2's forward (a per-thread switch, ``o2_policy.forward``). Left on
by an exception, a later ``bf16-mixed`` forward on the same thread would run O2's rules whenever the policy is
registered (an O2 Trainer run or another O2 Fabric model in the process): here an fp32 Parameter multiplying a
half activation would be cast to half (O2's elementwise-Parameter rule) where torch's autocast promotes to fp32.
Each test raises inside the forward of one entry point (the runtime, Fabric, the Trainer), then runs a
``bf16-mixed`` forward on the same thread with the policy registered and expects torch's result.
"""
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp import AmpO2Precision
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.runtime import AmpRuntime
from lightning_amp.fabric import FabricAmpO2Precision
from support.trainer import quiet_lightning

pytestmark = pytest.mark.skipif(not o2_policy.available(), reason="needs the compiled extension")


class Scaled(nn.Module):
    """``linear(x) * scale``: an elementwise op of a half activation and an fp32 Parameter under autocast."""

    def __init__(self, fail=False):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.scale, self.fail = nn.Linear(8, 8), nn.Parameter(torch.randn(8) + 2.0), fail

    def forward(self, x):
        out = self.linear(x) * self.scale
        if self.fail:
            assert o2_policy.active() and out.dtype == torch.bfloat16  # the premise: O2's rule ran
            raise RuntimeError("failed inside the O2 forward")
        return out


def _assert_bf16_mixed_is_torchs_on_this_thread():
    """With the policy registered, a bf16-mixed forward here gets torch's autocast: fp32 by promotion."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = fabric.setup(Scaled())
    with o2_policy.held():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            inner = model.module(x)
        outer = model(x)
    assert inner.dtype == torch.float32
    linear = model.module.linear
    with torch.no_grad():
        expected = F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float() * model.module.scale
    assert torch.equal(outer, expected) and torch.equal(inner, expected)
    assert not o2_policy.active()


def test_runtime_forward_context():
    amp = AmpRuntime("O2", dtype="bfloat16", device_type="cpu")
    module = amp.prepare(Scaled(fail=True), hold_policy=False)  # held for each forward context
    with pytest.raises(RuntimeError, match="inside the O2 forward"), amp.forward_context():
        module(torch.randn(4, 8))
    assert o2_policy.installs() == 0
    _assert_bf16_mixed_is_torchs_on_this_thread()


def test_fabric_forward():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricAmpO2Precision(dtype="bfloat16")])
    model = fabric.setup(Scaled(fail=True))
    with pytest.raises(RuntimeError, match="inside the O2 forward"):
        model(torch.randn(4, 8))
    _assert_bf16_mixed_is_torchs_on_this_thread()


class FailingStep(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Scaled(fail=True)

    def training_step(self, batch, batch_idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_training_step():
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        plugins=[AmpO2Precision(dtype="bfloat16")])
    with quiet_lightning(), pytest.raises(RuntimeError, match="inside the O2 forward"):
        trainer.fit(FailingStep(), torch.utils.data.DataLoader(torch.randn(4, 8), batch_size=2))
    assert o2_policy.installs() == 0  # the failed run's teardown released the policy
    _assert_bf16_mixed_is_torchs_on_this_thread()
