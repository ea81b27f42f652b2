"""The forward context of each level (amp/forward.py): autocast, O2's op policy, the default dtype."""
import lightning as L
import pytest
import torch
from torch import nn

from lightning_amp import AmpO2Precision, main_params
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.casts import active_cast
from lightning_amp.amp.forward import forward_context
from lightning_amp.amp.levels import resolve_properties
from lightning_amp.amp.module_cast import default_dtype, saturate
from support.trainer import LossRecorder, quiet_lightning

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _inside(level, dtype, **overrides):
    props = resolve_properties(opt_level=level, dtype=dtype, device_type="cpu", **overrides)
    with forward_context(props, "cpu"):
        return (torch.get_default_dtype(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                active_cast(), o2_policy.active(), torch.is_autocast_cache_enabled())


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_each_level_sets_its_forward_context_and_restores_it(dtype):
    fp32, cpu_default = torch.float32, torch.get_autocast_dtype("cpu")
    assert _inside("O0", dtype)[:5] == (fp32, False, cpu_default, None, False)
    assert _inside("O1", dtype) == (fp32, True, dtype, (dtype, "cpu"), False, False)
    cast = (dtype, "cpu")
    assert _inside("O2", dtype) == (fp32, True, dtype, cast, True, False)  # O1's autocast + O2's op policy
    assert _inside("O2", dtype, norm_policy="fp32") == (fp32, True, dtype, cast, False, False)
    assert _inside("O2", dtype, master_weights=False) == (fp32, True, dtype, cast, True, False)
    assert _inside("O3", dtype)[:2] == (dtype, False)  # pure half, as Lightning's bf16-true
    assert torch.get_default_dtype() == torch.float32 and not torch.is_autocast_enabled("cpu")
    assert not o2_policy.active()


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
def test_o2_trains_a_model_that_makes_fp32_tensors_in_forward_as_lightnings_precisions_do(dtype):
    """fp32 position features, an fp32 table registered on the first forward, LayerNorm and BatchNorm:
    O2's losses stay within 0.01 of ``32-true``'s and ``bf16-mixed``'s on the same seed, each of which
    falls by about 0.55 over the 5 steps (measured: at most 0.0026 apart)."""
    _, fp32 = _fit(MadeInForward(), precision="32-true")
    _, mixed = _fit(MadeInForward(), precision="bf16-mixed")
    model = MadeInForward()
    trainer, losses = _fit(model, plugins=[AmpO2Precision(dtype=dtype, init_scale=2.0**8)])
    assert fp32[0] - fp32[-1] > 0.5
    for reference in (fp32, mixed):
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 0.01, (losses, reference)
    assert model.table.dtype == torch.float32  # a buffer keeps the dtype the model gave it
    assert model.embed.weight.dtype == model.bn.weight.dtype == torch.float32
    assert list(main_params(trainer.optimizers[0])) == list(model.parameters())


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
