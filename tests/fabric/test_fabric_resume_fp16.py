"""A Fabric resume keeps an fp16 dynamic loss scaler whose scale has moved (issue 35).

``fabric.save`` stores each optimizer's scaler in its ``state_dict`` and ``fabric.load`` restores it, loaded
before the plugin has seen the optimizer (its first step) or after. Run in float16 with a dynamic scale that
grew and backed off before the save (at bf16's fixed 1.0 a dropped scaler could not show): the resumed run's
scaler state and skipped-step count equal the uninterrupted run's at every step, and so do the weights.
"""
import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_amp.fabric import FabricAmpO2Precision

STEPS, SAVE_AT, INF_AT = 7, 3, 1
SCALER = dict(init_scale=2.0**10, growth_interval=2)


def _setup():
    plugin = FabricAmpO2Precision(dtype="float16", loss_scale="dynamic", **SCALER)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, plugin, model, optimizer


def _train(fabric, plugin, model, optimizer, start, stop, save=None):
    """Steps ``start``..``stop - 1`` on per-step seeded batches (an inf grad at ``INF_AT``); the scaler state
    after each step."""
    states = []
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        fabric.backward(F.cross_entropy(model(x), y))
        if step == INF_AT:
            model.module[0].weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        states.append((plugin.scalers[0].state_dict(), plugin.skipped_steps))
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": optimizer})
    return states


@pytest.mark.parametrize("load_after_first_step", [False, True], ids=["load-before-first-step", "load-after-a-step"])
def test_fp16_dynamic_scaler_survives_fabric_save_and_load(tmp_path, load_after_first_step):
    ckpt = tmp_path / "ckpt.pt"
    fabric, plugin, model, optimizer = _setup()
    whole = _train(fabric, plugin, model, optimizer, 0, STEPS, save=ckpt)
    saved_scale = whole[SAVE_AT - 1][0]["scale"]
    assert saved_scale not in (SCALER["init_scale"], 1.0), whole  # the premise: the scale moved
    assert whole[SAVE_AT - 1][1] == 1  # and a step was skipped before the save

    fabric, plugin, model, optimizer = _setup()
    if load_after_first_step:  # the plugin has seen the optimizer: its load_state_dict hook restores the scaler
        _train(fabric, plugin, model, optimizer, 0, 1)
    fabric.load(ckpt, {"model": model, "optimizer": optimizer})
    resumed = _train(fabric, plugin, model, optimizer, SAVE_AT, STEPS)
    assert resumed == whole[SAVE_AT:]
    final = dict(model.state_dict())
    fabric, plugin, model, optimizer = _setup()
    _train(fabric, plugin, model, optimizer, 0, STEPS)
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in final.items())
