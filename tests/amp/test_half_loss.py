"""A half loss is scaled in fp32 and its backward does not overflow at the default scale (issue 25, item 2).

The backward of ``loss.float() * scale`` hands ``scale`` itself, in the loss's dtype, to the half graph
as the loss's gradient: 2**16, the dynamic scale's start, is inf in float16 (max 65504), so every first
step of a float16 loss overflowed and was skipped (the migration guide's own example skipped its first
step so). Each test trains on fresh random data from equal weights and compares with ``32-true``; the
effect named is a skipped step (the weights then lag a whole step behind the reference: 4 steps move
them 0.06-0.12 here, checked to be over 10x ``TOL``), the tolerance is float16 rounding (``TOL``).
"""
import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_amp import AmpPrecision
from lightning_amp.amp.engine import AmpEngine, root_scale_limit
from lightning_amp.amp.levels import resolve_properties
from lightning_amp.amp.scaler import LossScaler
from lightning_amp.fabric import FabricAmpO1Precision, FabricAmpO2Precision
from support.trainer import quiet_lightning

TOL = 4e-4  # max |weights - 32-true's| after 4 steps; measured 1.1e-4 (Trainer), 4.2e-5 (Fabric)
STEPS = 4


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def half_loss(logits, y):
    """Cross-entropy computed in float16 (outside autocast, which would make it fp32)."""
    with torch.autocast("cpu", enabled=False):
        return F.cross_entropy(logits.half(), y)


def fp32_loss(logits, y):
    return F.cross_entropy(logits.float(), y)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _data():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(16 * STEPS, 32, generator=gen), torch.randint(0, 4, (16 * STEPS,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class Net(L.LightningModule):
    """The migration guide's "After" model. ``losses``: the loss of each micro-batch, in turn."""

    def __init__(self, losses=(half_loss,), manual=False):
        super().__init__()
        self.net, self.losses, self.dtypes = _net(), losses, []
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.losses[batch_idx % len(self.losses)](self.net(x), y)
        self.dtypes.append(loss.dtype)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(model, precision, accumulate=1):
    plugin = AmpPrecision(precision, dtype="float16") if precision != "32-true" else None
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        accumulate_grad_batches=accumulate,
                        **({"plugins": [plugin]} if plugin else {"precision": precision}))
    trainer.fit(model, _data())
    return plugin


def _assert_close_to_reference(model, reference):
    diffs = [(p - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())]
    moved = max((p - q).abs().max().item() for p, q in zip(reference.parameters(), _net().parameters()))
    assert max(diffs) <= TOL < moved / 10, (diffs, moved)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("manual", [False, True])
def test_half_loss_trains_without_a_skipped_step_at_the_default_scale(level, manual, flag_timing):
    model = Net(manual=manual)
    plugin = _fit(model, level)
    assert set(model.dtypes) == {torch.float16}  # the premise: the loss is half
    assert plugin.skipped_steps == 0
    assert plugin.loss_scale == 2.0**15  # the scaler did not back off (capped at the half loss's backward)
    reference = Net(manual=manual)
    _fit(reference, "32-true")
    _assert_close_to_reference(model, reference)


def test_half_and_fp32_losses_accumulated_in_one_step(flag_timing):
    """Micro-batches alternating an fp32 loss and a half one accumulate into one step: the first step's fp32
    loss runs at 2**16, its half partner at 2**15 (which caps the scaler from then on), and the grads held
    from the first are re-based onto the second's factor."""
    model = Net(losses=(fp32_loss, half_loss))
    plugin = _fit(model, "O2", accumulate=2)
    assert plugin.skipped_steps == 0 and model.dtypes[:2] == [torch.float32, torch.float16]
    assert plugin.loss_scale == 2.0**15
    reference = Net(losses=(fp32_loss, half_loss))
    _fit(reference, "32-true", accumulate=2)
    _assert_close_to_reference(model, reference)


@pytest.mark.parametrize("plugin_cls", [FabricAmpO1Precision, FabricAmpO2Precision])
def test_fabric_backward_of_a_half_loss_does_not_skip(plugin_cls):
    weights, plugin = {}, plugin_cls(dtype="float16")
    for name, precision in (("ours", plugin), ("reference", "32-true")):
        fabric = L.Fabric(accelerator="cpu", devices=1, **({"plugins": [precision]} if name == "ours"
                                                           else {"precision": precision}))
        net = _net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        net, optimizer = fabric.setup(net, optimizer)
        for x, y in _data():
            fabric.backward(half_loss(net(x), y))
            optimizer.step()
            optimizer.zero_grad()
        weights[name] = [p.detach().float().clone() for p in net.parameters()]
    assert plugin.skipped_steps == 0 and plugin.loss_scale == 2.0**15
    assert max((a - b).abs().max().item() for a, b in zip(weights["ours"], weights["reference"])) <= TOL


def test_root_scale_limit_is_the_largest_power_of_two_of_the_dtype():
    assert root_scale_limit(torch.float16) == 2.0**15 <= torch.finfo(torch.float16).max < 2.0**16
    assert root_scale_limit(torch.bfloat16) == 2.0**127
    assert root_scale_limit(torch.float32) is None and root_scale_limit(torch.float64) is None


@pytest.mark.parametrize("static", [None, 2.0**20, 128.0])
def test_scale_loss_multiplies_in_fp32_and_caps_the_factor_of_a_half_loss(static):
    """The scaled loss is fp32 and the gradient it hands a float16 loss is finite; the grads carry the
    capped factor, and the scaler reports it (a scale below the cap is untouched)."""
    props = resolve_properties("O1", dtype="float16", loss_scale="dynamic" if static is None else static)
    engine = AmpEngine(lambda: LossScaler(props.loss_scale))
    weight = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    engine.connect([optimizer], {weight: ["weight"]})
    x = torch.randn(3, 8)
    loss = (x.half() @ weight.half()).tanh().mean()
    scaled = engine.scale_loss(loss)
    assert scaled.dtype == torch.float32
    scaled.backward()
    expected = min(static or 2.0**16, 2.0**15)
    assert float(engine.states[0].grad_factor) == expected
    assert torch.isfinite(weight.grad).all()
    reference = torch.autograd.grad((x.double() @ weight.double()).tanh().mean(), weight)[0].float()
    torch.testing.assert_close(weight.grad / expected, reference, rtol=2e-2, atol=1e-3)
    assert engine.scalers[0].scale == expected
