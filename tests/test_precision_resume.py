"""Exact resume: 2N steps straight == N steps, checkpoint, N more in a new Trainer (bitwise, CPU, every level)."""
import logging
import warnings

import lightning as L
import pytest
import torch
from torch import nn

from lightning_amp import AmpO2Plugin, AmpPrecision, main_params

N = 4  # steps per half: one epoch of 4 batches
# Halves are whole epochs (max_epochs): Lightning restarts a plain DataLoader from its first batch on
# resume, so a checkpoint taken mid-epoch could not continue the same data stream.


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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
    "O2-bf16": lambda: AmpO2Plugin(dtype="bfloat16"),
    "O2-fp16": lambda: AmpO2Plugin(dtype="float16", init_scale=2.0**17, growth_interval=2),
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


def test_o2_checkpoint_holds_fp32_masters_and_loads_into_a_plain_fp32_model(tmp_path):
    plugin = AmpO2Plugin(dtype="bfloat16")
    model = Net()
    trainer = _trainer(plugin, 1)
    trainer.fit(model, _loader())
    path = tmp_path / "o2.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)

    state = checkpoint["state_dict"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    masters = list(main_params(trainer.optimizers[0]))
    names = [name for name, _ in model.named_parameters()]
    for name, master in zip(names, masters):
        assert torch.equal(state[name], master)
    assert not torch.equal(state["net.0.weight"], state["net.0.weight"].bfloat16().float())  # not rounded
    assert "AmpO2Plugin" in checkpoint and checkpoint["AmpO2Plugin"]["loss_scalers"][0]["scale"] == 1.0

    plain = nn.Sequential(nn.Linear(10, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 4))
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()}, strict=True)
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert torch.equal(plain[0].weight, masters[0])


def _o2_checkpoint(tmp_path):
    plugin = AmpO2Plugin(dtype="bfloat16")
    trainer = _trainer(plugin, 1)
    trainer.fit(Net(), _loader())
    path = tmp_path / "o2.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("fault", ["missing", "reshaped"])
def test_master_without_matching_checkpoint_entry_raises_or_warns_by_option(tmp_path, fault):
    path = _o2_checkpoint(tmp_path)
    checkpoint = torch.load(path, weights_only=False)
    if fault == "missing":
        del checkpoint["state_dict"]["net.3.weight"]
    else:
        checkpoint["state_dict"]["net.3.weight"] = checkpoint["state_dict"]["net.3.weight"].reshape(-1)

    plugin = AmpO2Plugin(dtype="bfloat16")
    with pytest.raises(ValueError, match=r"net\.3\.weight.*allow_missing_masters"):
        _load_only(plugin, checkpoint)  # the hook itself (Lightning's strict load may refuse earlier)

    lenient = AmpO2Plugin(dtype="bfloat16", allow_missing_masters=True)
    model = Net()
    trainer = _trainer(lenient, 1)
    trainer.fit(model, _loader())  # connects the masters
    masters = {id(h): m for s in lenient._states for h, m in s.masters.pairs}
    kept = masters[id(model.net[3].weight)].clone()
    with pytest.warns(UserWarning, match=r"net\.3\.weight"):
        lenient.on_load_checkpoint(checkpoint)
    assert torch.equal(masters[id(model.net[3].weight)], kept)
    assert torch.equal(masters[id(model.net[0].weight)], checkpoint["state_dict"]["net.0.weight"])


def _load_only(plugin, checkpoint):
    model = Net()
    _trainer(plugin, 1).fit(model, _loader())
    plugin.on_load_checkpoint(checkpoint)


def test_saving_a_master_whose_entry_is_gone_raises(tmp_path):
    plugin = AmpO2Plugin(dtype="bfloat16")
    trainer = _trainer(plugin, 1)
    trainer.fit(Net(), _loader())
    checkpoint = {"state_dict": {k: v for k, v in trainer.lightning_module.state_dict().items() if k != "net.0.bias"}}
    with pytest.raises(ValueError, match=r"net\.0\.bias"):
        plugin.on_save_checkpoint(checkpoint)
