"""The forward context of each level (amp/forward.py): default dtype and autocast, and fp32 tensors made in forward."""
import copy
import pickle

import lightning as L
import pytest
import torch
import torchmetrics
from torch import nn

from _lightning import LossRecorder, quiet_lightning
from lightning_amp import AmpO2Plugin, main_params
from lightning_amp.amp.casts import active_cast
from lightning_amp.amp.forward import default_dtype, forward_context
from lightning_amp.amp.half_inputs import half_inputs
from lightning_amp.amp.module_cast import saturate
from lightning_amp.amp.half_params import HalfParams, prepare_o2_module_
from lightning_amp.amp.levels import resolve_properties

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _inside(level, dtype, **overrides):
    props = resolve_properties(opt_level=level, dtype=dtype, device_type="cpu", **overrides)
    half_params = None
    if level == "O2" and props.master_weights:
        model = prepare_o2_module_(nn.Linear(2, 2), dtype, keep_batchnorm_fp32=True)
        half_params = HalfParams(model, dtype, keep_batchnorm_fp32=True)
    with forward_context(props, "cpu", half_params):
        return torch.get_default_dtype(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), active_cast()


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_each_level_sets_its_forward_context_and_restores_it(dtype):
    assert _inside("O0", dtype) == (torch.float32, False, torch.get_autocast_dtype("cpu"), None)
    assert _inside("O1", dtype) == (torch.float32, True, dtype, (dtype, "cpu"))
    assert _inside("O2", dtype)[:2] == (dtype, False)  # half tables by default, fp32 ones cast at modules
    assert _inside("O2", dtype, master_weights=False) == (dtype, True, dtype, None)  # no module here: autocast
    assert _inside("O3", dtype)[:2] == (dtype, False)  # pure half, as Lightning's bf16-true
    assert torch.get_default_dtype() == torch.float32 and not torch.is_autocast_enabled("cpu")


def test_default_dtype_is_restored_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with default_dtype(BF16):
            assert torch.zeros(1).dtype == BF16
            raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32


class MadeInForward(L.LightningModule):
    """Builds fp32 tensors on purpose inside forward, where the default dtype cannot reach them.

    A sinusoidal position feature from ``torch.arange(...).float()`` goes through a Linear, and a
    projection table is registered as an fp32 buffer on the first forward (after the cast).
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.position = nn.Linear(8, 16)
        self.embed = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        if not hasattr(self, "table"):
            self.register_buffer("table", torch.randn(16, 16, dtype=torch.float32, generator=torch.Generator().manual_seed(3)))
        steps = torch.arange(x.shape[1], device=x.device).float()[:, None]
        freqs = torch.exp(torch.arange(4, dtype=torch.float32) * -1.0)
        sinusoid = torch.cat([torch.sin(steps * freqs), torch.cos(steps * freqs)], dim=-1)
        hidden = self.norm(self.embed(x) + self.position(sinusoid)) @ self.table
        return self.head(self.bn(hidden.mean(dim=1)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(model, **trainer_kwargs):
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 5, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen))
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="cpu", max_steps=5, callbacks=[recorder], logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(model, torch.utils.data.DataLoader([batch] * 5, batch_size=None))
    return trainer, recorder.losses


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_o2_trains_a_model_that_makes_fp32_tensors_in_forward(dtype):
    _, reference = _fit(MadeInForward(), precision="bf16-mixed")  # Lightning's mixed precision trains it
    model = MadeInForward()
    trainer, losses = _fit(model, plugins=[AmpO2Plugin(dtype=dtype, init_scale=2.0**8)])
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert reference[-1] < reference[0]
    assert model.embed.weight.dtype == model.bn.weight.dtype == torch.float32  # forward saw half copies
    assert list(main_params(trainer.optimizers[0])) == list(model.parameters())


# ----------------------------------------------------------------------------- amp/half_inputs.py


class _Seen(nn.Module):
    """Records the dtypes of the floating tensors it is called with (positional, keyword, in a tuple)."""

    def forward(self, x, pair=(), *, mask=None):
        self.seen = (x.dtype, tuple(t.dtype for t in pair), None if mask is None else mask.dtype)
        return x


class _Parent(nn.Module):
    """Makes fp32 tensors inside forward and hands them to a child by position, in a tuple and by keyword."""

    def __init__(self):
        super().__init__()
        self.child, self.bn, self.loss = _Seen(), nn.BatchNorm1d(4), nn.MSELoss()

    def forward(self, x):
        table = torch.arange(4, dtype=torch.float32)
        self.child(x + 0, (table, table.long()), mask=torch.zeros(4, dtype=torch.float64))
        return self.loss(self.bn(x.float()), torch.ones(2, 4))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_half_inputs_casts_fp32_inputs_of_submodules_and_runs_losses_in_fp32(dtype):
    model = _Parent()
    bn_inputs = []
    model.bn.register_forward_pre_hook(lambda m, a: bn_inputs.append(a[0].dtype))
    x = torch.randn(2, 4)
    with half_inputs(model, dtype, keep_batchnorm_fp32=True):
        loss = model(x)
    assert model.child.seen == (dtype, (dtype, torch.int64), dtype)  # by position, in a tuple, by keyword
    assert bn_inputs == [torch.float32]  # a BatchNorm kept fp32 is left alone
    assert loss.dtype == torch.float32

    model(x)  # outside the block nothing is cast
    assert model.child.seen == (torch.float32, (torch.float32, torch.int64), torch.float64)
    half = torch.randn(2, 4, dtype=dtype)
    assert nn.MSELoss()(half, half).dtype == dtype  # loss modules are plain again


def test_half_inputs_reaches_loss_modules_made_inside_forward_and_modules_added_later():
    model = nn.Sequential(nn.Identity())
    with half_inputs(model, BF16, keep_batchnorm_fp32=True):
        logits = torch.randn(3, 5, dtype=BF16)
        assert nn.CrossEntropyLoss()(logits, torch.tensor([0, 1, 4])).dtype == torch.float32
    model.append(_Seen())
    with half_inputs(model, BF16, keep_batchnorm_fp32=True):
        model(torch.randn(2))
    assert model[1].seen[0] == BF16


def test_half_inputs_leaves_metrics_alone_and_stores_late_buffers_half():
    model = nn.Module()
    model.metric = torchmetrics.SumMetric()
    model.metric.features = _Seen()  # a network inside a metric (FID's Inception, ...)
    value = torch.tensor(511.0)
    with half_inputs(model, BF16, keep_batchnorm_fp32=True):
        model.metric(value)
        model.metric.features(value)
        model.register_buffer("table", torch.full((2,), 1e5, dtype=torch.float32))
        nn.Module().register_buffer("steps", torch.zeros(2, dtype=torch.long))  # integer buffers stay
    assert model.metric.compute() == 511.0  # bf16 would read 512
    assert model.metric.features.seen[0] == torch.float32
    assert model.table.dtype == BF16
    model.register_buffer("outside", torch.zeros(1))
    assert model.outside.dtype == torch.float32


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_saturate_keeps_fp32_masks_finite_and_in_range_values_exact(dtype):
    info = torch.finfo(dtype)
    big = torch.tensor([torch.finfo(torch.float32).min, float("-inf"), float("inf"), 1e39 if dtype == F16 else 0.0])
    assert saturate(big, dtype).tolist() == [info.min, info.min, info.max, info.max if dtype == F16 else 0.0]
    assert torch.isfinite(big.to(dtype)[:1]).item() is False  # what a plain cast makes of an fp32 mask
    assert torch.isnan(saturate(torch.tensor([float("nan")]), dtype)).all()
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100
    assert torch.equal(saturate(values, dtype), values.to(dtype))
    wide = torch.tensor([1.5, -2.0, 1e38, -1e38], requires_grad=True)  # 1e38 is beyond fp16, within bf16
    saturate(wide, dtype).float().sum().backward()
    beyond = 1.0 if dtype == BF16 else 0.0
    assert wide.grad.tolist() == [1.0, 1.0, beyond, beyond]  # as through a clamp
    assert wide.tolist()[2] == pytest.approx(1e38)  # the input itself is untouched


def test_half_inputs_hooks_survive_deepcopy_and_pickle_and_bad_dtype_is_refused():
    model = _Parent()
    with half_inputs(model, BF16, keep_batchnorm_fp32=True):
        model(torch.randn(2, 4))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with half_inputs(clone, F16, keep_batchnorm_fp32=True):
            clone(torch.randn(2, 4))
        assert clone.child.seen[0] == F16
        assert len(clone.child._forward_pre_hooks) == 1  # hooked once
    with pytest.raises(ValueError, match="`dtype` must be torch.float16 or torch.bfloat16"):
        with half_inputs(model, torch.float32, keep_batchnorm_fp32=True):
            pass
