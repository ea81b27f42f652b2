"""How ``optimizer.step`` is called, per dtype, as Lightning's own precisions call it (issue 38, item 4).

Lightning's ``16-mixed`` steps through ``torch.amp.GradScaler.step(optimizer, **kwargs)``, which calls
``optimizer.step(**kwargs)`` with no ``closure`` (the closure ran before); ``bf16-mixed`` (like ``32-true``)
calls ``optimizer.step(closure=closure, **kwargs)``. Ours: where the loss is scaled (float16, or any level
given a scale), as ``GradScaler.step``; where it is not (bfloat16, O3's default static 1.0), as ``bf16-mixed``.
The oracle is Lightning itself: the same optimizer and module under ``16-mixed`` (with a CPU ``GradScaler``:
on the CPU Lightning makes none by default) and under ``bf16-mixed``, and Lightning's own
``test_amp_gradient_unscale`` (tests/tests_pytorch/models/test_amp.py), ported to the CPU.
"""
import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_amp import AmpPrecision
from support.trainer import quiet_lightning

INIT_SCALE = 2.0 ** 8  # for every scaler here: BoringModel's float16 grads overflow at 2**16 in some draws
SCALED = {  # our plugin arguments whose loss is scaled: GradScaler.step's call
    "O1": dict(opt_level="O1", dtype="float16", init_scale=INIT_SCALE),
    "O2": dict(opt_level="O2", dtype="float16", init_scale=INIT_SCALE),
    "O3": dict(opt_level="O3", dtype="float16", loss_scale="dynamic", init_scale=INIT_SCALE),
    "O1-static": dict(opt_level="O1", dtype="float16", loss_scale=INIT_SCALE),  # a static scale scales the loss too
    "O2-static": dict(opt_level="O2", dtype="float16", loss_scale=INIT_SCALE),
}
UNSCALED = {  # ... and those whose loss is not: bf16-mixed's call
    "O1": dict(opt_level="O1", dtype="bfloat16"),
    "O2": dict(opt_level="O2", dtype="bfloat16"),
    "O3": dict(opt_level="O3", dtype="bfloat16"),
    "O3-fp16-static-1": dict(opt_level="O3", dtype="float16"),
}


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _lightnings(kind):
    if kind == "16-mixed":  # Lightning's 16-mixed as on a GPU: through a GradScaler
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))]}
    return {"precision": kind}


def _trainer(precision, **kwargs):
    L.seed_everything(0, verbose=False)  # BoringModel's data are drawn from the global generator
    extra = {"plugins": [AmpPrecision(**precision)]} if isinstance(precision, dict) else _lightnings(precision)
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False, **extra, **kwargs)


def _shape(args, kwargs):
    """What a step call looked like: positional count, keyword names, and whether ``closure`` is callable."""
    return len(args), tuple(sorted(kwargs)), callable(kwargs.get("closure"))


class _SpySGD(torch.optim.SGD):
    """Records the shape of every ``step`` call (a subclass's own step: the plugin calls it, as Lightning does)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.calls = []

    def step(self, *args, **kwargs):
        self.calls.append(_shape(args, kwargs))
        closure = kwargs.get("closure")
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        super().step()
        return loss


class _SpyModel(BoringModel):
    """``how``: the optimizer as it comes, its step patched on the instance, or wrapped by a decorator."""

    def __init__(self, how="own"):
        super().__init__()
        self.how = how

    def configure_optimizers(self):
        opt = _SpySGD(self.parameters(), lr=0.01)
        if self.how == "patched":  # a plain function put over the bound method, as tracing tools do
            own = opt.step
            opt.step = lambda *args, **kwargs: own(*args, **kwargs)
        elif self.how == "wrapped":
            opt.step = functools.wraps(opt.step)(functools.partial(type(opt).step, opt))
        return opt


def _calls(precision, how):
    model = _SpyModel(how)
    _trainer(precision, max_steps=3).fit(model)
    return model.optimizers().optimizer.calls


@pytest.mark.parametrize("how", ["own", "patched", "wrapped"])
@pytest.mark.parametrize("level", list(SCALED))
def test_a_scaled_loss_steps_as_16_mixed_steps(level, how):
    reference = _calls("16-mixed", how)
    assert reference == [(0, (), False)] * 3  # GradScaler.step: no closure
    assert _calls(SCALED[level], how) == reference


@pytest.mark.parametrize("how", ["own", "patched", "wrapped"])
@pytest.mark.parametrize("level", list(UNSCALED))
def test_an_unscaled_loss_steps_as_bf16_mixed_steps(level, how):
    reference = _calls("bf16-mixed", how)
    assert reference == [(0, ("closure",), True)] * 3
    assert _calls(UNSCALED[level], how) == reference


# ---- Lightning's test_amp_gradient_unscale, on the CPU ----------------------------------------------------


class _ClippingOptimizer(torch.optim.SGD):
    """Lightning's ``TestClippingOptimizer``: its step takes no ``closure`` (as ``GradScaler.step`` calls it)."""

    def step(self, *args, pl_module=None):
        pl_module.check_grads_clipped()
        return super().step(*args)


class _ClippingOptimizerTakingTheClosure(torch.optim.SGD):
    """The same for ``bf16-mixed``, which hands ``closure=`` to the step (Lightning's own optimizer would raise
    TypeError there too): it runs the closure, as torch's optimizers do."""

    def step(self, closure=None, pl_module=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        pl_module.check_grads_clipped()
        super().step()
        return loss


class _PrecisionModel(BoringModel):
    """Lightning's ``TestPrecisionModel``: grads scaled in ``on_after_backward``, unscaled in
    ``on_before_optimizer_step``, clipped by value in ``configure_gradient_clipping``, checked clipped in
    the optimizer's step, which the module's ``optimizer_step`` calls with ``pl_module=self``."""

    def __init__(self, optimizer_cls, scaled):
        super().__init__()
        self.optimizer_cls, self.scaled, self.steps_seen = optimizer_cls, scaled, 0

    def _scale(self):
        plugin = self.trainer.precision_plugin
        return plugin.scaler.get_scale() if isinstance(plugin, MixedPrecision) else plugin.loss_scale

    def on_after_backward(self):
        scale = self._scale() if self.scaled else 1.0
        if self.scaled:
            assert scale != 1.0
        self.original_grads = [p.grad / scale for p in self.parameters()]  # a sum over micro-batches at one scale

    def check_grads_unscaled(self):
        for actual, expected in zip([p.grad for p in self.parameters()], self.original_grads):
            torch.testing.assert_close(actual, expected)

    def check_grads_clipped(self):
        for actual, expected in zip(self.parameters(), self.clipped_parameters):
            torch.testing.assert_close(actual.grad, expected.grad)
        self.steps_seen += 1

    def on_before_optimizer_step(self, optimizer):
        self.check_grads_unscaled()
        self.clipped_parameters = []
        for p in self.parameters():
            copy = p.detach().clone()
            copy.grad = p.grad.clone()
            self.clipped_parameters.append(copy)
        torch.nn.utils.clip_grad_value_(self.clipped_parameters, self.trainer.gradient_clip_val)

    def configure_gradient_clipping(self, *args, **kwargs):
        super().configure_gradient_clipping(*args, **kwargs)
        self.check_grads_clipped()
        self.steps_seen -= 1  # counted in the optimizer's step

    def optimizer_step(self, epoch, batch_idx, optimizer, closure, **_):
        optimizer.step(closure, pl_module=self)

    def configure_optimizers(self):
        return self.optimizer_cls(self.layer.parameters(), lr=0.1)


def _unscale_fit(precision, optimizer_cls, scaled, accum):
    model = _PrecisionModel(optimizer_cls, scaled)
    trainer = _trainer(precision, max_epochs=2, limit_train_batches=2, limit_val_batches=0,
                       gradient_clip_val=1e-3, gradient_clip_algorithm="value", log_every_n_steps=1,
                       accumulate_grad_batches=accum)
    trainer.fit(model)
    assert model.steps_seen == 4 // accum  # every step reached the optimizer (nothing skipped at these scales)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("precision", ["16-mixed", *SCALED])
def test_lightnings_amp_gradient_unscale_float16(precision, accum):
    """Lightning's test as it is: an optimizer whose step takes no closure, at 16-mixed (the oracle) and O1-O3."""
    _unscale_fit(SCALED.get(precision, precision), _ClippingOptimizer, True, accum)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("precision", ["bf16-mixed", "O1", "O2", "O3"])
def test_lightnings_amp_gradient_unscale_bfloat16(precision, accum):
    """The same under bfloat16 (no scale), with the optimizer taking the closure bf16-mixed hands it."""
    _unscale_fit(UNSCALED.get(precision, precision), _ClippingOptimizerTakingTheClosure, False, accum)


def test_the_float16_optimizer_fails_under_bf16_mixed_as_under_our_bfloat16():
    """The premise of the split: Lightning's own bf16-mixed hands this optimizer ``closure=``, and so do we."""
    for precision in ("bf16-mixed", UNSCALED["O2"]):
        with pytest.raises(TypeError, match="closure"):
            _unscale_fit(precision, _ClippingOptimizer, False, 1)
