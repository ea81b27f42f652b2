"""The reported loss scale is the factor the grads carry (issue 35).

A float16 loss's backward runs at most at 2**15 (``AmpEngine.scale_loss``: 2**16 is inf in float16), so at
O3 float16 with a dynamic scale the grads between backward and step carry 2**15. Lightning's idiom divides
them by the reported scale (``scaler.get_scale()`` under ``16-mixed``, ``plugin.loss_scale`` here): the scaler
is capped at the backward's factor, so that gives the true grads, and its growth and backoff start from it.
The effect named is a factor of 2; grads are compared with an fp64 reference on the same float16 weights and
batch within float16 rounding (``RTOL``).
"""
import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_amp import AmpO3Precision
from lightning_amp.amp.engine import AmpEngine
from lightning_amp.amp.scaler import LossScaler
from lightning_amp.fabric import FabricAmpO3Precision
from support.trainer import quiet_lightning

RTOL = 2e-2  # |grad / scale - fp64 grad| relative to the largest grad: float16 rounding, far below a factor 2


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _batches(steps, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(steps)]


def _reference_grads(net, x, y):
    """The fp64 grads of the cross-entropy at ``net``'s (float16) weights."""
    params = [p.detach().double().requires_grad_() for p in net.parameters()]
    w1, b1, w2, b2 = params
    logits = F.linear(F.relu(F.linear(x.double(), w1, b1)), w2, b2)
    return torch.autograd.grad(F.cross_entropy(logits, y), params)


def _assert_divided_grads_are_true(grads, scale, reference):
    assert scale == 2.0**15  # the premise: float16 caps the backward below the initial 2**16
    for grad, ref in zip(grads, reference):
        err = (grad.double() / scale - ref).abs().max().item()
        assert err <= RTOL * ref.abs().max().item(), (err, ref.abs().max().item())


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class HalfLossNet(L.LightningModule):
    """O3 float16: the logits and so the loss are float16. Records ``p.grad / plugin.loss_scale`` after each
    backward (Lightning's idiom for the true grads in ``on_after_backward``) with that step's fp64 grads."""

    def __init__(self):
        super().__init__()
        self.net, self.seen = _net(), []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        assert loss.dtype == torch.float16
        self._reference = _reference_grads(self.net, x, y)
        return loss

    def on_after_backward(self):
        grads = [p.grad.clone() for p in self.net.parameters()]
        self.seen.append((grads, self.trainer.precision_plugin.loss_scale, self._reference))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_o3_float16_grads_divided_by_the_reported_scale_are_the_true_grads():
    model, plugin = HalfLossNet(), AmpO3Precision(dtype="float16", loss_scale="dynamic", growth_interval=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, plugins=[plugin])
    x, y = (torch.cat(t) for t in zip(*_batches(3)))
    trainer.fit(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8))
    assert len(model.seen) == 3 and plugin.skipped_steps == 0
    for grads, scale, reference in model.seen:
        _assert_divided_grads_are_true(grads, scale, reference)
    assert plugin.loss_scale == 2.0**15  # growth every clean step (growth_interval=1) stops at the backward's cap


def test_fabric_o3_float16_grads_divided_by_the_reported_scale_are_the_true_grads():
    plugin = FabricAmpO3Precision(dtype="float16", loss_scale="dynamic")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net, optimizer = fabric.setup(net, optimizer)
    optimizer.step()  # the plugin learns an optimizer at its first step (a backward before it is not scaled)
    for x, y in _batches(3):
        logits = net.module(x.half())  # the float16 logits (Fabric's forward would return them as fp32)
        reference = _reference_grads(net.module, x.half(), y)
        fabric.backward(F.cross_entropy(logits, y))
        _assert_divided_grads_are_true([p.grad for p in net.parameters()], plugin.loss_scale, reference)
        optimizer.step()
        optimizer.zero_grad()
    assert plugin.skipped_steps == 0


def _engine(**scaler_kwargs):
    engine = AmpEngine(lambda: LossScaler("dynamic", **scaler_kwargs))
    weight = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
    optimizer = torch.optim.SGD([weight], lr=1e-3)
    engine.connect([optimizer], {weight: ["weight"]})
    return engine, weight, optimizer


def _step(engine, weight, optimizer, seed, overflow=False):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed)).half()
    loss = (x @ weight.half()).tanh().mean()
    engine.scale_loss(loss).backward()
    factor = float(engine.states[0].grad_factor)
    if overflow:
        weight.grad[0, 0] = float("inf")
    engine.step(optimizer, lambda: None, grads_read=False)
    optimizer.zero_grad()
    return factor


def test_dynamic_scale_grows_to_and_backs_off_from_the_factor_the_grads_carry():
    """Growth stops at the cap, one overflow backs off below it at once, the next backward runs at the
    reported scale; a resumed engine (state_dict at the capped scale) continues the same trajectory."""
    engine, weight, optimizer = _engine(growth_interval=1)
    factors = [_step(engine, weight, optimizer, seed) for seed in range(3)]
    assert factors == [2.0**15] * 3 and engine.scalers[0].scale == 2.0**15
    _step(engine, weight, optimizer, 3, overflow=True)
    assert engine.scalers[0].scale == 2.0**14  # one overflow: below the backward's factor at once
    saved = engine.state_dict()
    resumed, r_weight, r_optimizer = _engine(growth_interval=1)
    resumed.load_state_dict(saved)
    r_weight.data.copy_(weight.data)
    for seed, factor in ((4, 2.0**14), (5, 2.0**15), (6, 2.0**15)):
        assert _step(engine, weight, optimizer, seed) == _step(resumed, r_weight, r_optimizer, seed) == factor
        assert engine.scalers[0].scale == resumed.scalers[0].scale == 2.0**15
    assert torch.equal(weight, r_weight)


@pytest.mark.parametrize("static", [2.0**20, 128.0])
def test_a_static_scale_above_the_cap_is_reported_at_it(static):
    engine = AmpEngine(lambda: LossScaler(static))
    weight = torch.nn.Parameter(torch.randn(8, 4))
    engine.connect([torch.optim.SGD([weight], lr=0.1)], {weight: ["weight"]})
    engine.scale_loss((torch.randn(3, 8).half() @ weight.half()).sum()).backward()
    assert engine.scalers[0].scale == float(engine.states[0].grad_factor) == min(static, 2.0**15)
    engine.scale_loss((torch.randn(3, 8) @ weight).sum()).backward()  # an fp32 loss afterwards: same scale
    assert float(engine.states[0].grad_factor) == min(static, 2.0**15)
