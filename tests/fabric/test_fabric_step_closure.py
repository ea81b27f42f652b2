"""A patched or hooked optimizer ``step`` under Fabric runs, and gets the ``closure=`` a loop passed to
``optimizer.step``, as under Fabric's own ``bf16-mixed`` (which hands it to ``optimizer.step``); where the loss is
scaled (float16) it is called without it, as ``GradScaler.step`` calls it. The closure runs once per step."""
import lightning as L
import pytest
import torch
from lightning.fabric.plugins import MixedPrecision

from lightning_amp.fabric import FabricAmpO1Precision, FabricAmpO2Precision

TORCH_ADAMW_STEP = torch.optim.AdamW.step


def _run(plugin_or_name, how, monkeypatch):
    """Three Fabric steps with a closure; the closures the optimizer's ``step`` saw, the closure's call count,
    and the trained weights."""
    kwargs = {"precision": plugin_or_name} if isinstance(plugin_or_name, str) else {"plugins": [plugin_or_name]}
    fabric = L.Fabric(accelerator="cpu", devices=1, **kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    if how == "class":
        def patched(self, closure=None):
            seen.append(closure)
            return TORCH_ADAMW_STEP(self, closure)

        monkeypatch.setattr(torch.optim.AdamW, "step", patched)
    else:
        optimizer.register_step_pre_hook(lambda opt, args, kw: seen.append(kw.get("closure")))
    model, optimizer = fabric.setup(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    calls = []
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)

        def closure():
            calls.append(1)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss)
            return loss

        optimizer.step(closure=closure)
    return seen, len(calls), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("how", ["class", "pre_hook"])
@pytest.mark.parametrize("plugin", [FabricAmpO1Precision, FabricAmpO2Precision])
def test_a_patched_or_hooked_step_gets_the_closure_as_under_bf16_mixed(plugin, how, monkeypatch):
    ref_seen, ref_calls, _ = _run("bf16-mixed", how, monkeypatch)
    seen, calls, params = _run(plugin(dtype="bfloat16"), how, monkeypatch)
    assert ref_calls == calls == 3
    assert len(seen) == len(ref_seen) == 3
    assert all(callable(c) for c in ref_seen + seen)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("how", ["class", "pre_hook"])
@pytest.mark.parametrize("plugin", [FabricAmpO1Precision, FabricAmpO2Precision])
def test_a_scaled_loss_steps_without_the_closure_as_grad_scaler_does(plugin, how, monkeypatch):
    """float16: Fabric's ``16-mixed`` steps through ``GradScaler.step``, which calls ``step`` without a closure
    (and refuses a loop's closure); ours runs the loop's closure once, then calls ``step`` as GradScaler does."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        _run(MixedPrecision("16-mixed", "cpu", scaler=scaler), how, monkeypatch)
    seen, calls, params = _run(plugin(dtype="float16", init_scale=2.0 ** 8), how, monkeypatch)
    assert calls == 3 and seen == [None] * 3
    assert all(torch.isfinite(p).all() for p in params)
