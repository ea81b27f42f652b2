"""A model that is tensor-parallel already (the user kept the DTensor ``parallelize`` function of Lightning's
ModelParallelStrategy and picked ``tp_fused`` too) is refused before anything changes, with a ValueError naming the
first DTensor parameter (or the module holding torch's tensor-parallel hooks) and the two ways forward, under the
Trainer and Fabric (before: torch's ``NotImplementedError: Operator c10d.broadcast_.default does not have a sharding
strategy registered`` from inside the setup). And the plan report of a Trainer run: logged at setup on rank 0, kept
as ``trainer.strategy.plan_report``. One process, a one-rank gloo group."""
from __future__ import annotations

import logging

import lightning as L
import lightning.pytorch as pl
import pytest
import lightning_utilities.core.rank_zero as rank_zero_module
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp  # noqa: F401  (registers "tp_fused")
from lightning_amp.parallel.convert import PARALLEL_LAYERS
from support import torchtitan_llama as tt
from support.processes import free_port

REFUSAL = (r"tp_fused.*tensor-parallel already: its parameter 'layers\.0\.attention\.wq\.weight' is a DTensor "
           r"\(placements \(Shard\(dim=0\),\).*drop your parallelize function.*ModelParallelStrategy.*Nothing was changed")
TOKENS = torch.randint(64, (4, 9), generator=torch.Generator().manual_seed(0))


def parallelize(model: nn.Module, inputs_only: bool = False) -> nn.Module:
    """What the user's ModelParallelStrategy function did: torchtitan's plan for one block's attention."""
    mesh = init_device_mesh("cpu", (1,))
    block = model.layers["0"]
    if inputs_only:  # hooks only, no DTensor parameter
        parallelize_module(block, mesh, {"attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate()),
                                                                         desired_input_layouts=(Replicate(), Replicate()))})
    else:
        parallelize_module(block.attention, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                                   "wv": ColwiseParallel(), "wo": RowwiseParallel()})
    return model


def _unchanged(model: nn.Module, before: dict) -> None:
    assert not any(isinstance(m, PARALLEL_LAYERS) for m in model.modules())
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        assert torch.equal(local, before[name]), name


def _snapshot(model: nn.Module) -> dict:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def test_fabric_refuses_a_model_parallelized_already(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="tp_fused")
    fabric.launch()
    try:
        torch.manual_seed(0)
        model = parallelize(tt.Transformer(tt.ModelArgs()))
        before = _snapshot(model)
        with pytest.raises(ValueError, match=REFUSAL):
            fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        _unchanged(model, before)
        hooked = parallelize(tt.Transformer(tt.ModelArgs()), inputs_only=True)
        with pytest.raises(ValueError, match=r"its module 'layers\.0\.attention' carries a hook of torch's tensor "
                                             r"parallelism \(PrepareModuleInput\._apply\).*ModelParallelStrategy"):
            fabric.setup_module(hooked)
        assert not any(isinstance(m, PARALLEL_LAYERS) for m in hooked.modules())
    finally:
        dist.destroy_process_group()


class TitanModule(pl.LightningModule):
    """The torchtitan Llama in a LightningModule; ``parallelized``: its configure_model applies the user's DTensor
    plan, as under ModelParallelStrategy."""

    def __init__(self, parallelized: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.parallelized, self.before = tt.Transformer(tt.ModelArgs()), parallelized, None

    def configure_model(self) -> None:
        if self.parallelized and self.before is None:
            parallelize(self.model)
            self.before = _snapshot(self.model)

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        return nn.functional.cross_entropy(self.model(tokens[:, :-1]).reshape(-1, 64), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="tp_fused", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(module, DataLoader(TensorDataset(TOKENS), batch_size=4))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return trainer


def test_trainer_refuses_a_model_parallelized_already(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    module = TitanModule(parallelized=True)
    with pytest.raises(ValueError, match=REFUSAL.replace("'layers", "'model\\.layers")):
        _fit(module)
    _unchanged(module, {f"model.{k}": v for k, v in module.before.items()})


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_trainer_logs_the_plan_report_on_rank_0_and_keeps_it(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    # the logger rank_zero_info writes to (Lightning points it at its own "...utilities.rank_zero" loggers, which
    # stop propagating to the root logger once Lightning has set its handlers up, and which an earlier test's
    # quiet_lightning() may have raised to ERROR: caplog would see nothing)
    logger, handler, level = rank_zero_module.log, _Messages(), rank_zero_module.log.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        trainer = _fit(TitanModule(parallelized=False))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    report = trainer.strategy.plan_report
    assert [(u.family, u.found_by) for u in report.split].count(("attention", "structure")) == 2
    assert list(report.whole) == ["model.output"]
    logged = [m for m in handler.messages if "tp_fused plan at" in m]
    assert len(logged) == 1 and logged[0].endswith(report.format())
    assert "model.layers.0.attention.wq" in logged[0] and "left whole" in logged[0]
