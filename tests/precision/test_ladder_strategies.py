"""The precision ladder under strategies it does not support: refused with the reason before anything is cast.

tp_fused: at ``Trainer(...)``/``Fabric(...)`` (the strategy's precision setter); FSDP2's ModelParallelStrategy: at
setup, before the plugin casts the model (Trainer: ``convert_module``; Fabric: ``fabric.setup``). DDP is supported
and proven against one process in test_auto_ddp.py.
"""
import warnings

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import ModelParallelStrategy

from support.processes import free_port
from lightning_amp import AmpAutoPrecision, AmpO2Precision
from lightning_amp.fabric import FabricAmpAutoPrecision, FabricAmpO2Precision

REFUSED = r'opt_level="auto" \(the precision ladder\) is not supported under {}.*Allowed: strategy="auto"'


def test_tp_fused_refuses_the_ladder_when_the_trainer_and_fabric_are_built():
    with pytest.raises(ValueError, match=REFUSED.format("strategy='tp_fused'")):
        L.Trainer(accelerator="cpu", strategy="tp_fused", plugins=[AmpAutoPrecision(dtype="float16")])
    with pytest.raises(ValueError, match=REFUSED.format("strategy='tp_fused'")):
        L.Fabric(accelerator="cpu", strategy="tp_fused", plugins=[FabricAmpAutoPrecision(dtype="float16")])
    L.Trainer(accelerator="cpu", strategy="tp_fused", plugins=[AmpO2Precision(dtype="float16")])  # a fixed level is fine
    L.Fabric(accelerator="cpu", strategy="tp_fused", plugins=[FabricAmpO2Precision(dtype="float16")])


class _Parallelized(BoringModel):
    def configure_model(self):  # ModelParallelStrategy requires it; the refusal comes before the plugin's cast
        pass


@pytest.fixture
def one_process_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_fsdp2_refuses_the_ladder_at_setup_before_the_model_is_cast(one_process_group):
    model, plugin = _Parallelized(), AmpAutoPrecision(dtype="float16")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), max_steps=1, logger=False,
                        plugins=[plugin], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=REFUSED.format("ModelParallelStrategy")):
        warnings.simplefilter("ignore")
        trainer.fit(model)
    assert plugin.amp.module is None  # never prepared


def test_fabric_fsdp2_refuses_the_ladder_when_fabric_is_built(one_process_group):
    """Fabric's plugin sees the strategy where the wrapped Fabric connector does (plugin_kinds.py): before any setup."""
    plugin = FabricAmpAutoPrecision(dtype="float16")
    module = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=REFUSED.format("ModelParallelStrategy")):
        L.Fabric(accelerator="cpu", devices=1, strategy=FabricModelParallel(lambda module, mesh: module), plugins=[plugin])
    assert plugin.amp.module is None and all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
