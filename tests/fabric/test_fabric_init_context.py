"""Models created under ``Fabric.init_module()`` get the level's param dtype, as under Fabric's ``HalfPrecision``:
half at O3, torch's default dtype restored afterwards; fp32 at O0-O2, as under ``32-true`` and the mixed precisions.
(The plugin's own ``tensor_init_context``/``module_init_context``, Fabric's and the Trainer's, are tested together
in tests/precision/test_init_context.py.)"""
import lightning as L
import pytest
import torch

from lightning_amp.fabric import FabricAmpO1Precision, FabricAmpO2Precision, FabricAmpO3Precision

HALF = [("bf16-true", "bfloat16", torch.bfloat16), ("16-true", "float16", torch.float16)]


@pytest.mark.parametrize(("precision", "dtype", "expected_dtype"), HALF)
def test_fabric_init_module_creates_half_params_at_o3(precision, dtype, expected_dtype):
    for kwargs in ({"precision": precision}, {"plugins": [FabricAmpO3Precision(dtype=dtype)]}):
        fabric = L.Fabric(accelerator="cpu", devices=1, **kwargs)
        with fabric.init_module():
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        assert {p.dtype for p in model.parameters()} == {expected_dtype}, kwargs
        assert torch.get_default_dtype() == torch.float32
        model = fabric.setup(model)
        assert model(torch.randn(3, 4)).dtype == torch.float32  # outputs back to the default dtype, as Fabric's


@pytest.mark.parametrize("plugin_cls", [FabricAmpO1Precision, FabricAmpO2Precision])
def test_fabric_init_module_keeps_fp32_params_below_o3(plugin_cls):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin_cls(dtype="bfloat16")])
    with fabric.init_module():
        model = torch.nn.Linear(4, 8)
    assert model.weight.dtype == torch.float32
