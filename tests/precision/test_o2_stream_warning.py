"""O2's stream forensics through the plugins (issue 46, item 3): one ``Fp32StreamWarning`` the first time an
fp32 activation promotes the half stream inside an O2 forward, naming the op, the module and the ways out;
``warn_on_fp32_stream=False`` silences it; anything but a bool is refused at construction, naming the argument."""
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp import AmpO2Precision
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.o2.stream_watch import Fp32StreamWarning
from lightning_amp.fabric import FabricAmpO2Precision
from support.trainer import quiet_lightning

pytestmark = pytest.mark.skipif(not o2_policy.available(), reason="needs the compiled extension")


class _Fp32Residual(nn.Module):
    """Keeps its residual stream in fp32 on purpose (``residual_in_fp32``, as Mamba's blocks may)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, x):
        residual = x.float()
        for _ in range(9):  # deep enough to be an activation, not an expression of Parameters
            residual = residual * 1.0
        return self.mix(x) + residual


class _Model(L.LightningModule):
    def __init__(self, promote: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.block = _Fp32Residual() if promote else nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]).float(), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)) for _ in range(3)]


def _fit(model, **plugin_kwargs):
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        plugins=[AmpO2Precision(dtype="bfloat16", **plugin_kwargs)])
    with quiet_lightning(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, torch.utils.data.DataLoader(_batches(), batch_size=None))
    return [w for w in caught if issubclass(w.category, Fp32StreamWarning)]


def test_one_warning_names_the_op_the_module_and_the_ways_out():
    caught = _fit(_Model(promote=True))
    assert len(caught) == 1, [str(w.message) for w in caught]  # once, over 3 steps
    message = str(caught[0].message)
    assert "aten::add" in message and "BFloat16[6, 8]" in message and "Float[6, 8]" in message
    assert "module 'block' (_Fp32Residual)" in message and __file__ in message
    assert "register_half_function" in message and "warn_on_fp32_stream=False" in message
    assert caught[0].filename == __file__


def test_no_warning_when_the_stream_stays_half_or_when_turned_off():
    assert _fit(_Model(promote=False)) == []
    assert _fit(_Model(promote=True), warn_on_fp32_stream=False) == []


@pytest.mark.parametrize("plugin", [AmpO2Precision, FabricAmpO2Precision])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_warn_on_fp32_stream_takes_a_bool_only(plugin, value):
    with pytest.raises(TypeError, match="`warn_on_fp32_stream` must be True or False"):
        plugin(warn_on_fp32_stream=value)


def test_fabric_warns_too():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricAmpO2Precision(dtype="bfloat16")])
    model = fabric.setup_module(_Model(promote=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, _ in _batches():
            model(x)
    assert len([w for w in caught if issubclass(w.category, Fp32StreamWarning)]) == 1
