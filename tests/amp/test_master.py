"""lightning_amp.amp.param_views and amp.module_cast: optimizer grad views and in-place model casts, no Lightning."""
import pytest
import torch
from torch import nn

from lightning_amp.amp.param_views import optimizer_grads
from lightning_amp.amp.module_cast import cast_floating, cast_module_, cast_outputs_hook

HALVES = [torch.float16, torch.bfloat16]


def test_optimizer_grads_leaves_out_params_without_grad():
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([a, b], lr=0.1)
    a.grad = torch.randn(4)
    assert optimizer_grads(opt) == [a.grad]


@pytest.mark.parametrize("dtype", HALVES)
def test_cast_module_in_place_keeps_parameter_identity_and_fp32_batchnorm(dtype):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 5))
    reference = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 5))
    reference.load_state_dict(model.state_dict())
    ids = [id(p) for p in model.parameters()]
    cast_module_(model, dtype, keep_batchnorm_fp32=True)
    cast_module_(model, dtype, keep_batchnorm_fp32=True)  # idempotent: hooks installed once
    assert [id(p) for p in model.parameters()] == ids
    assert model[0].weight.dtype == dtype and model[2].weight.dtype == dtype
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    assert model[1].num_batches_tracked.dtype == torch.int64
    assert len(model[1]._forward_pre_hooks) == 1 and len(model[1]._forward_hooks) == 1

    x = torch.randn(9, 7)
    hidden = model[0](x.to(dtype))
    out_bn = model[1](hidden)
    assert out_bn.dtype == dtype
    # BatchNorm ran in fp32 on the half input: same as an fp32 BatchNorm on the upcast input
    expected = reference[1](hidden.float())
    assert torch.equal(out_bn, expected.to(dtype))
    assert torch.allclose(model[1].running_mean, reference[1].running_mean)


def test_cast_module_without_keep_casts_batchnorm_too():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    cast_module_(model, torch.bfloat16, keep_batchnorm_fp32=False)
    assert model[1].weight.dtype == torch.bfloat16 and model[1].running_var.dtype == torch.bfloat16
    assert not model[1]._forward_pre_hooks


def test_cast_floating_and_output_hook():
    batch = {"x": torch.randn(2, 3), "idx": torch.arange(2), "pair": (torch.randn(1), [torch.randn(2)])}
    out = cast_floating(batch, torch.float16)
    assert out["x"].dtype == torch.float16 and out["idx"].dtype == torch.int64
    assert out["pair"][0].dtype == torch.float16 and out["pair"][1][0].dtype == torch.float16

    model = cast_module_(nn.Linear(3, 2), torch.bfloat16)
    cast_outputs_hook(model, torch.float32)
    cast_outputs_hook(model, torch.float32)
    assert len(model._forward_hooks) == 1
    assert model(torch.randn(4, 3).bfloat16()).dtype == torch.float32
    cast_outputs_hook(model, None)
    assert model(torch.randn(4, 3).bfloat16()).dtype == torch.bfloat16


def test_cast_module_rejects_non_modules():
    with pytest.raises(TypeError, match="module"):
        cast_module_(torch.randn(3), torch.float16)


def test_former_module_name_still_imports_with_a_deprecation_warning():
    import importlib
    import sys

    sys.modules.pop("lightning_amp.amp.master", None)
    with pytest.warns(DeprecationWarning, match="lightning_amp.amp.param_views"):
        master = importlib.import_module("lightning_amp.amp.master")
    from lightning_amp.amp import param_views

    assert master.optimizer_grads is param_views.optimizer_grads and master.param_name is param_views.param_name
