"""lightning_amp.amp.master and amp.module_cast: fp32 masters and in-place model casts, no Lightning."""
import pytest
import torch
from torch import nn

from lightning_amp.amp.master import MasterParams, nonfinite_flags, optimizer_grads, rescale_grads_, unscale_grads_
from lightning_amp.amp.module_cast import cast_floating, cast_module_, cast_outputs_hook

HALVES = [torch.float16, torch.bfloat16]


def _half_model(dtype, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.ReLU(), nn.Linear(13, 5))
    cast_module_(model, dtype, keep_batchnorm_fp32=True)
    return model


@pytest.mark.parametrize("dtype", HALVES)
def test_masters_replace_half_params_in_param_groups(dtype):
    model = _half_model(dtype)
    half_params = list(model.parameters())
    frozen = model[3].bias
    frozen.requires_grad_(False)
    opt = torch.optim.SGD([{"params": half_params[:2]}, {"params": half_params[2:], "lr": 0.5}], lr=0.1)
    masters = MasterParams(opt)

    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert [p.dtype for p in stepped] == [torch.float32] * len(half_params)
    assert [p.dtype for p in model.parameters()] == [dtype, dtype, torch.float32, torch.float32, dtype, dtype]
    # BatchNorm params are fp32 already: they are their own masters
    assert stepped[2] is model[1].weight and stepped[3] is model[1].bias
    assert len(masters.pairs) == 4
    for half, master in masters.pairs:
        assert master is not half and torch.equal(master, half.float())
        assert master.requires_grad == half.requires_grad
    assert masters.master_of[frozen].requires_grad is False
    assert opt.param_groups[1]["lr"] == 0.5


def test_existing_state_moves_to_master_as_fp32():
    model = _half_model(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    weight = model[0].weight
    opt.state[weight] = {"step": torch.tensor(3.0), "exp_avg": torch.randn(13, 7).bfloat16()}
    masters = MasterParams(opt)
    master = masters.master_of[weight]
    assert weight not in opt.state
    assert opt.state[master]["exp_avg"].dtype == torch.float32
    assert opt.state[master]["step"].item() == 3.0


def test_registry_shares_one_master_between_optimizers():
    model = _half_model(torch.float16)
    shared = model[0].weight
    opt_a = torch.optim.SGD([shared, model[0].bias], lr=0.1)
    opt_b = torch.optim.SGD([shared, model[3].weight], lr=0.1)
    registry = {}
    a, b = MasterParams(opt_a, registry), MasterParams(opt_b, registry)
    assert a.master_of[shared] is b.master_of[shared]


@pytest.mark.parametrize("dtype", HALVES)
def test_grads_accumulate_in_fp32_and_halves_refresh_from_masters(dtype):
    model = _half_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterParams(opt)
    weight = model[0].weight
    torch.manual_seed(1)
    micro_grads = [torch.randn(13, 7, dtype=torch.float64) * 1e-3 + 1.0 for _ in range(8)]
    for grad in micro_grads:
        weight.grad = grad.to(dtype)
        masters.accumulate_model_grads_()
        assert weight.grad is None
    master = masters.master_of[weight]
    reference = sum(g.to(dtype).double() for g in micro_grads)  # exact sum of the half grads
    assert master.grad.dtype == torch.float32
    assert torch.allclose(master.grad.double(), reference, rtol=1e-6, atol=0)
    # a half accumulator would have lost the small parts: make sure the test can tell
    half_sum = micro_grads[0].to(dtype)
    for g in micro_grads[1:]:
        half_sum = half_sum + g.to(dtype)
    assert (half_sum.double() - reference).abs().max() > (master.grad.double() - reference).abs().max()

    with torch.no_grad():
        master.add_(torch.randn_like(master) * 1e-2)
    masters.copy_to_model_()
    assert torch.equal(weight, master.to(dtype))


def test_load_masters_sets_masters_and_rounds_halves():
    model = _half_model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterParams(opt)
    weight = model[0].weight
    value = torch.randn(13, 7)
    assert masters.load_masters_({weight: value}) == 1
    assert torch.equal(masters.master_of[weight], value)
    assert torch.equal(weight, value.bfloat16())
    with pytest.raises(ValueError, match="shape"):
        masters.load_masters_({weight: torch.randn(7, 13)})


def test_unscale_grads_matches_fp64_and_flags_nonfinite_tensors():
    torch.manual_seed(2)
    grads = [torch.randn(33, 17) * 4096, torch.randn(5) * 4096, torch.randn(3, 3, 3) * 4096]
    reference = [g.double() / 4096 for g in grads]
    found_inf, flags = unscale_grads_(grads, 1.0 / 4096)
    assert found_inf.item() == 0.0 and flags.tolist() == [0.0, 0.0, 0.0]
    for g, r in zip(grads, reference):
        assert torch.allclose(g.double(), r, rtol=1e-7, atol=0)

    grads[1][2] = float("nan")
    grads[2][0, 1, 2] = float("-inf")
    found_inf, flags = unscale_grads_(grads, 0.5)
    assert found_inf.item() == 1.0 and flags.tolist() == [0.0, 1.0, 1.0]
    found_inf, flags = nonfinite_flags(grads)
    assert found_inf.item() == 1.0 and flags.tolist() == [0.0, 1.0, 1.0]


def test_rescale_and_optimizer_grads():
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([a, b], lr=0.1)
    a.grad = torch.randn(4)
    expected = a.grad * 0.25
    assert optimizer_grads(opt) == [a.grad]
    rescale_grads_(optimizer_grads(opt), 0.25)
    assert torch.equal(a.grad, expected)


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


def test_exposed_main_grad_is_used_at_full_precision():
    """The tensor-parallel strategy accumulates into an fp32 ``main_grad`` and exposes a rounded
    ``.grad``: the master must take the fp32 values, not the rounded ones."""
    model = _half_model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masters = MasterParams(opt)
    weight = model[0].weight
    weight.main_grad = torch.randn(13, 7) * 1e-3 + 1.0
    weight.grad = weight.main_grad.to(torch.bfloat16)
    masters.accumulate_model_grads_()
    master_grad = masters.master_of[weight].grad
    assert master_grad is weight.main_grad and weight.grad is None
    assert not torch.equal(master_grad, master_grad.bfloat16().float())
