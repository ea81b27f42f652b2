"""The forward context of each level (amp/forward.py): default dtype and autocast, and fp32 tensors made in forward."""
import lightning as L
import pytest
import torch
from torch import nn

from _lightning import LossRecorder, quiet_lightning
from lightning_amp import AmpO2Plugin, main_params
from lightning_amp.amp.casts import active_cast
from lightning_amp.amp.forward import default_dtype, forward_context
from lightning_amp.amp.levels import resolve_properties

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _inside(level, dtype):
    props = resolve_properties(opt_level=level, dtype=dtype, device_type="cpu")
    with forward_context(props, "cpu"):
        return torch.get_default_dtype(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), active_cast()


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_each_level_sets_its_forward_context_and_restores_it(dtype):
    assert _inside("O0", dtype) == (torch.float32, False, torch.get_autocast_dtype("cpu"), None)
    assert _inside("O1", dtype) == (torch.float32, True, dtype, (dtype, "cpu"))
    assert _inside("O2", dtype) == (dtype, True, dtype, None)  # half tables by default, autocast for fp32 ones
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
