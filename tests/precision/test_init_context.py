"""Models created under ``Trainer.init_module()`` / the plugin's ``tensor_init_context()`` (the Trainer's and
Fabric's plugins) get the level's param dtype, as under Lightning's ``HalfPrecision`` (``bf16-true``/``16-true``:
tests_pytorch/plugins/precision/test_half.py's ``test_module_init_context``): half at O3, with torch's default
dtype restored afterwards; fp32 at O0-O2 (Lightning's ``32-true`` and mixed precisions create fp32 params)."""
import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalfPrecision
from lightning.pytorch.plugins import HalfPrecision

from lightning_amp import AmpO0Precision, AmpO1Precision, AmpO2Precision, AmpO3Precision
from lightning_amp.fabric import FabricAmpO3Precision

HALF = [("bf16-true", "bfloat16", torch.bfloat16), ("16-true", "float16", torch.float16)]


@pytest.mark.parametrize(("precision", "dtype", "expected_dtype"), HALF)
@pytest.mark.parametrize("context", ["tensor_init_context", "module_init_context"])
@pytest.mark.parametrize(("half_cls", "o3_cls"),
                         [(HalfPrecision, AmpO3Precision), (FabricHalfPrecision, FabricAmpO3Precision)], ids=["trainer", "fabric"])
def test_module_init_context(precision, dtype, expected_dtype, context, half_cls, o3_cls):
    """The Trainer's plugin and Fabric's, each beside Lightning's own HalfPrecision of the same family."""
    for plugin in (half_cls(precision=precision), o3_cls(dtype=dtype)):
        assert torch.get_default_dtype() == torch.float32
        with getattr(plugin, context)():
            model = torch.nn.Linear(2, 2)
            assert torch.get_default_dtype() == expected_dtype
        assert model.weight.dtype == model.bias.dtype == expected_dtype, type(plugin).__name__
        assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("precision", "dtype", "expected_dtype"), HALF)
def test_trainer_init_module_creates_half_params_at_o3(precision, dtype, expected_dtype):
    """``Trainer.init_module()`` as under ``Trainer(precision="bf16-true")``; an exception inside restores the dtype."""
    for kwargs in ({"precision": precision}, {"plugins": [AmpO3Precision(dtype=dtype)]}):
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, **kwargs)
        with trainer.init_module():
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        assert {p.dtype for p in model.parameters()} == {expected_dtype}, kwargs
        assert torch.get_default_dtype() == torch.float32
        with pytest.raises(RuntimeError, match="inside init"), trainer.init_module():
            raise RuntimeError("inside init")
        assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("plugin_cls", [AmpO0Precision, AmpO1Precision, AmpO2Precision])
def test_trainer_init_module_keeps_fp32_params_below_o3(plugin_cls):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, plugins=[plugin_cls(dtype="bfloat16")]
                        if plugin_cls is not AmpO0Precision else [plugin_cls()])
    with trainer.init_module():
        model = torch.nn.Linear(4, 8)
        assert torch.get_default_dtype() == torch.float32
    assert model.weight.dtype == torch.float32


def test_o3_with_fp32_params_creates_them_fp32():
    """``master_weights=True`` keeps O3's params fp32: they are created fp32."""
    with AmpO3Precision(dtype="bfloat16", master_weights=True).tensor_init_context():
        model = torch.nn.Linear(2, 2)
    assert model.weight.dtype == torch.float32
