"""O3 casts the batch to half *saturating*: an fp32 additive mask at ``finfo(float32).min`` must not
become ``-inf`` (a fully masked softmax row would turn NaN and every step with one would be skipped).
The Trainer's O2 leaves the batch as it comes, as the Trainer's ``bf16-mixed`` does (its autocast casts where
an op needs it); Fabric's O1/O2 cast a forward's inputs, as Fabric's ``bf16-mixed`` does."""
import collections
import dataclasses

import lightning as L
import pytest
import torch
from torch import nn

from lightning_amp import AmpPrecision
from lightning_amp.amp.module_cast import cast_floating
from lightning_amp.fabric import FabricAmpPrecision
from support.trainer import LossRecorder, quiet_lightning

F32_MIN = torch.finfo(torch.float32).min
Pair = collections.namedtuple("Pair", "mask ids")


@dataclasses.dataclass(frozen=True)
class Batch:
    mask: torch.Tensor
    scale: float


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saturating_cast_reaches_every_container_and_keeps_values_in_range(dtype):
    info = torch.finfo(dtype)
    wide = torch.tensor([F32_MIN, float("-inf"), float("inf"), float("nan"), 0.5], dtype=torch.float64)
    ids = torch.arange(3)
    data = {"pair": Pair(wide, ids), "list": [wide.float()], "batch": Batch(wide, 2.0)}
    out = cast_floating(data, dtype, saturating=True)
    for tensor in (out["pair"].mask, out["list"][0], out["batch"].mask):
        assert tensor.dtype == dtype
        assert tensor[:3].tolist() == [info.min, info.min, info.max]
        assert torch.isnan(tensor[3]) and tensor[4].item() == 0.5
    assert out["pair"].ids is ids and out["batch"].scale == 2.0
    plain = cast_floating(data, dtype)["pair"].mask  # the plain cast (outputs, BatchNorm) keeps infs
    assert plain[1].item() == float("-inf") and plain[2].item() == float("inf")


class _MaskedAttention(L.LightningModule):
    """One attention layer over a batch ``(x, additive_mask)``; the mask hides every key of the
    padding queries (rows fully masked at ``finfo(float32).min``, as a collator builds them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, mask = batch
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + mask, dim=-1)
        return self.out(attn @ v).float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _masked_batches(n=4, seq=6):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n * 2, seq, 8, generator=generator)
    mask = torch.zeros(n * 2, seq, seq)
    mask[:, :, seq - 2:] = F32_MIN  # the last two keys are padding
    mask[:, seq - 2:, :] = F32_MIN  # and the padding queries see nothing
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, mask), batch_size=2)


def _fit(precision=None, plugins=()):
    model, losses = _MaskedAttention(), LossRecorder()
    with quiet_lightning():
        trainer = L.Trainer(accelerator="cpu", max_steps=4, precision=precision, plugins=list(plugins),
                            callbacks=[losses], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, _masked_batches())
    return model, losses.losses, trainer


@pytest.mark.parametrize("level, weight_tol", [("O2", 0.1), ("O3", 0.35)])  # O3: bf16 weights round by ~0.2 of the move
def test_fully_masked_rows_of_an_fp32_batch_mask_train_like_fp32(level, weight_tol):
    reference, ref_losses, _ = _fit(precision="32-true")
    model, losses, trainer = _fit(plugins=[AmpPrecision(level, dtype="bfloat16")])
    assert trainer.precision_plugin.skipped_steps == 0  # a -inf mask made every loss NaN: 4 skipped steps
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=0.05)
    moved = (reference.qkv.weight.float() - _MaskedAttention().qkv.weight).abs().max()
    assert (model.qkv.weight.float() - reference.qkv.weight).abs().max() < weight_tol * moved


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fabric_plugin_casts_the_inputs_saturating(level):
    """Fabric's forward inputs are cast at O1-O3, as Fabric's bf16-mixed and bf16-true cast them
    (tests/fabric/test_fabric_convert.py); saturating, so the mask stays finite. The Trainer's O1/O2 leave
    the batch alone, as the Trainer's bf16-mixed does."""
    x, mask = next(iter(_masked_batches()))
    half_x, half_mask = FabricAmpPrecision(level, dtype="bfloat16").convert_input((x, mask))
    assert half_mask.dtype == torch.bfloat16 and torch.isfinite(half_mask).all()
    assert torch.equal(half_x, x.bfloat16())
    same_x, same_mask = FabricAmpPrecision("O0").convert_input((x, mask))
    assert same_x is x and same_mask is mask
    if level != "O3":
        same_x, same_mask = AmpPrecision(level, dtype="bfloat16").convert_input((x, mask))
        assert same_x is x and same_mask is mask
