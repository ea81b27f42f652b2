"""Fabric's O1/O2 convert a forward's inputs and outputs as Fabric's ``bf16-mixed``/``16-mixed`` do (issue 35):
floating inputs to the half dtype (``MixedPrecision.convert_input``), floating outputs back to the default dtype
(``convert_output``); integer tensors untouched. Compared with Fabric's own plugin on the same module and inputs."""
import lightning as L
import pytest
import torch

from lightning.fabric.plugins.precision import MixedPrecision

from lightning_amp.fabric import FabricAmpO0Precision, FabricAmpO1Precision, FabricAmpO2Precision


class Recorder(torch.nn.Module):
    """Records the dtypes its forward receives; returns a dict of floating and integer outputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.seen = []

    def forward(self, x, mask, ids, scale=None):
        self.seen.append((x.dtype, mask.dtype, ids.dtype, scale.dtype))
        h = self.proj(x) + mask
        return {"logits": h * scale, "ids": ids + 1, "pair": (h.sum(-1), h)}


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=gen)
    mask = torch.where(torch.rand(4, 8, generator=gen) > 0.3, 0.0, -1e4)
    return x, mask, torch.randint(0, 5, (4,), generator=gen), torch.rand(8, generator=gen) + 0.5


def _forward(precision):
    """``precision``: a name of Fabric's, or a plugin (Fabric on the CPU turns ``precision="16-mixed"`` into
    ``bf16-mixed``: its own ``MixedPrecision("16-mixed", "cpu")`` is then given as a plugin)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, **({"precision": precision} if isinstance(precision, str)
                                                         else {"plugins": [precision]}))
    module = Recorder()
    model = fabric.setup(module)
    x, mask, ids, scale = _inputs()
    out = model(x, mask, ids, scale=scale)
    return module.seen, out


def _dtypes(out):
    return {"logits": out["logits"].dtype, "ids": out["ids"].dtype, "pair": tuple(t.dtype for t in out["pair"])}


@pytest.mark.parametrize(("fabric_precision", "dtype"), [("bf16-mixed", "bfloat16"), ("16-mixed", "float16")])
@pytest.mark.parametrize("plugin_cls", [FabricAmpO1Precision, FabricAmpO2Precision])
def test_inputs_and_outputs_converted_as_fabrics_mixed_precision(fabric_precision, dtype, plugin_cls):
    seen_fabric, out_fabric = _forward(MixedPrecision(fabric_precision, device="cpu"))
    seen_ours, out_ours = _forward(plugin_cls(dtype=dtype))
    half = getattr(torch, dtype)
    assert seen_fabric == [(half, half, torch.int64, half)]  # the premise: Fabric casts floating inputs
    assert seen_ours == seen_fabric
    assert _dtypes(out_ours) == _dtypes(out_fabric) == {"logits": torch.float32, "ids": torch.int64,
                                                        "pair": (torch.float32, torch.float32)}
    assert torch.equal(out_ours["ids"], out_fabric["ids"])
    assert torch.equal(out_ours["logits"], out_fabric["logits"])  # same half inputs, same autocast matmul


def test_o0_converts_nothing_as_32_true():
    assert _forward(FabricAmpO0Precision())[0] == _forward("32-true")[0] == [(torch.float32, torch.float32, torch.int64, torch.float32)]
