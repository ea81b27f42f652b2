"""Exact resume: 2N steps straight == N steps, checkpoint, N more in a new Trainer (bitwise, CPU, every level)."""
import pathlib

import lightning as L
import pytest
import torch
from torch import nn

from lightning_amp import AmpO2Precision, AmpPrecision, main_params
from support.trainer import quiet_lightning

N = 4  # steps per half: one epoch of 4 batches
# Halves are whole epochs (max_epochs): Lightning restarts a plain DataLoader from its first batch on
# resume, so a checkpoint taken mid-epoch could not continue the same data stream.


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(10, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader():
    gen = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 10, generator=gen), torch.randint(0, 4, (64,), generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=16)


def _trainer(plugin, epochs):
    return L.Trainer(
        accelerator="cpu", max_epochs=epochs, plugins=[plugin], logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )


def _snapshot(trainer, model, plugin):
    opt = trainer.optimizers[0]
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "main": [p.detach().clone() for p in main_params(opt)],
        "state": [{k: v.clone() for k, v in opt.state[p].items()} for p in main_params(opt)],
        "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],  # settles late flags
        "scaler": plugin.state_dict()["loss_scalers"],
        "skipped": plugin.skipped_steps,
    }


CASES = {
    "O0": lambda: AmpPrecision("O0"),
    "O1-bf16": lambda: AmpPrecision("O1", dtype="bfloat16"),
    "O1-fp16": lambda: AmpPrecision("O1", dtype="float16", init_scale=2.0**20, growth_interval=2),
    "O2-bf16": lambda: AmpO2Precision(dtype="bfloat16"),
    "O2-fp16": lambda: AmpO2Precision(dtype="float16", init_scale=2.0**17, growth_interval=2),
    "O3-bf16": lambda: AmpPrecision("O3", dtype="bfloat16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_exact(case, tmp_path, flag_timing):
    straight_plugin = CASES[case]()
    straight_model = Net()
    straight = _trainer(straight_plugin, 2)
    straight.fit(straight_model, _loader())
    expected = _snapshot(straight, straight_model, straight_plugin)

    first_plugin = CASES[case]()
    first = _trainer(first_plugin, 1)
    first.fit(Net(), _loader())
    path = tmp_path / "half.ckpt"
    first.save_checkpoint(path)

    plugin = CASES[case]()
    if case == "O2-fp16":  # the generic class reads the state a shorthand class saved
        plugin = AmpPrecision("O2", dtype="float16", init_scale=2.0**17, growth_interval=2)
    model = Net()
    with torch.no_grad():  # a different start, so only the checkpoint can make the runs agree
        for p in model.parameters():
            p.add_(1.0)
    resumed = _trainer(plugin, 2)
    resumed.fit(model, _loader(), ckpt_path=path)
    got = _snapshot(resumed, model, plugin)

    for key in ("model", "main", "state"):
        assert _equal(expected[key], got[key]), key
    assert got["sched"] == expected["sched"] == 2 * N - expected["skipped"]
    assert got["scaler"] == expected["scaler"] and got["skipped"] == expected["skipped"]
    if case == "O1-fp16" or case == "O2-fp16":
        assert expected["skipped"] > 0  # the scale started too high: the scaler state mattered
    assert first_plugin.skipped_steps < N  # the first half did train


def _equal(a, b):
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def test_o2_checkpoint_holds_the_fp32_params_and_loads_into_a_plain_fp32_model(tmp_path):
    plugin = AmpO2Precision(dtype="bfloat16")
    model = Net()
    trainer = _trainer(plugin, 1)
    trainer.fit(model, _loader())
    path = tmp_path / "o2.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)

    state = checkpoint["state_dict"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    masters = list(main_params(trainer.optimizers[0]))
    assert masters == list(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    for name, master in zip(names, masters):
        assert torch.equal(state[name], master)
    assert not torch.equal(state["net.0.weight"], state["net.0.weight"].bfloat16().float())  # not rounded
    assert "AmpO2Precision" in checkpoint and checkpoint["AmpO2Precision"]["loss_scalers"][0]["scale"] == 1.0

    plain = nn.Sequential(nn.Linear(10, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 4))
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()}, strict=True)
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert torch.equal(plain[0].weight, masters[0])


FORMER_DESIGN = pathlib.Path(__file__).parent / "data" / "o2_former_design.ckpt"


def test_checkpoint_of_the_former_o2_design_resumes_with_its_fp32_masters(tmp_path):
    """tests/precision/data/o2_former_design.ckpt was saved by the former O2 design (main at 260711c: half module
    params, private fp32 masters written over the state_dict) after one epoch of ``Net`` with
    ``AmpO2Precision(dtype="bfloat16")``. It loads: the module's fp32 params take the master values
    bit for bit (not their bf16 rounding) and the optimizer its fp32 state."""
    checkpoint = torch.load(FORMER_DESIGN, weights_only=False)
    masters = checkpoint["state_dict"]
    assert not torch.equal(masters["net.0.weight"], masters["net.0.weight"].bfloat16().float())
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["params"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            opt = trainer.optimizers[0]
            seen["state"] = [{k: v.clone() for k, v in opt.state[p].items()} for p in main_params(opt)]

    plugin = AmpO2Precision(dtype="bfloat16")
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, plugins=[plugin], logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[Probe()])
    model = Net()
    trainer.fit(model, _loader(), ckpt_path=FORMER_DESIGN)
    for name, value in masters.items():
        if value.is_floating_point() and "running" not in name:
            assert seen["params"][name].dtype == torch.float32 and torch.equal(seen["params"][name], value), name
    saved_state = checkpoint["optimizer_states"][0]["state"]
    for index, state in enumerate(seen["state"]):
        for key, value in state.items():
            assert torch.equal(value.float(), saved_state[index][key].float()), (index, key)
    assert trainer.global_step == 2 * N


class TwoOptimizers(Net):
    """``Net`` with one SGD for each Linear, stepped by hand (manual optimization)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self(x).float(), y))
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[3].parameters(), lr=0.1)]


@pytest.mark.parametrize("saved,resumed", [(TwoOptimizers, Net), (Net, TwoOptimizers)], ids=["2-into-1", "1-into-2"])
def test_a_checkpoint_of_another_optimizer_count_is_refused_naming_both(saved, resumed, tmp_path):
    """Restoring the scalers of the first optimizers only (what a warning used to announce) is no exact resume."""
    first = _trainer(AmpPrecision("O1", dtype="float16"), 1)
    first.fit(saved(), _loader())
    path = tmp_path / "saved.ckpt"
    first.save_checkpoint(path)
    counts = (2, 1) if saved is TwoOptimizers else (1, 2)
    trainer = _trainer(AmpPrecision("O1", dtype="float16"), 2)
    with pytest.raises(ValueError, match=rf"checkpoint holds the loss scalers of {counts[0]} optimizer\(s\) but "
                                         rf"this run has {counts[1]}"):
        trainer.fit(resumed(), _loader(), ckpt_path=path)
    assert trainer.global_step == 0  # refused before any step
