"""apex's L0 optimizer tests (``tests/L0/run_optimizers``), adapted to this package on the CPU: their inputs,
their oracle (torch's own optimizer on the same tensors), their tolerances.

* ``test_fused_optimizer.py``'s ``TestFusedSGD``: one tensor of 278011 ``torch.rand`` elements, grads
  ``torch.rand_like`` shared by both optimizers, lr 0.25, momentum 0.125, 7 steps, after each step the largest
  absolute difference <= 1e-3 and the largest relative one <= 1 (apex's ``get_max_diff``: a Python ``>``
  comparison, so a nan ratio (0/0) is passed over, an inf one is not).
* ``test_adam.py``'s ``AdamTest.testGradScaler``: a small conv net, ``torch.optim.Adam`` under
  ``GradScaler`` against the fused optimizer under another ``GradScaler``, iterations from the same weights
  (the test copies the reference's weights into the tested model after every step: each iteration is the
  same check on new inputs, so 5 here instead of apex's 100, to keep the suite fast), weights and
  grads of every Conv2d/Linear close to atol = rtol = 1e-3 after each ``scaler.step``: the grads the fused
  optimizer leaves behind must be the unscaled ones, as torch's non-fused step sees them after
  ``scaler.unscale_``. Here also for FusedSGD, FusedAdadelta (against torch's) and FusedLAMB (grads only:
  torch has no LAMB), and the skipped step as torch's ``fused=True`` Adam: grads left as they were.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_amp import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD



def _max_diff(ref_params, tst_params):
    """apex's ``get_max_diff``, comparisons included (a nan ratio never exceeds the running maximum)."""
    max_abs_diff = max_rel_diff = 0
    for p_ref, p_tst in zip(ref_params, tst_params):
        max_abs_diff_p = (p_ref - p_tst).abs().max().item()
        max_rel_diff_p = ((p_ref - p_tst) / p_ref).abs().max().item()
        if max_abs_diff_p > max_abs_diff:
            max_abs_diff = max_abs_diff_p
        if max_rel_diff_p > max_rel_diff:
            max_rel_diff = max_rel_diff_p
    return max_abs_diff, max_rel_diff


@pytest.mark.parametrize("param_type", [torch.float32, torch.float16], ids=["float", "half"])
def test_fused_sgd_matches_torch_sgd(param_type, path):
    """TestFusedSGD.test_float / test_half. fp16: torch's SGD updates with the momentum buffer as stored
    (rounded to fp16); updating with the fp32 momentum before that rounding drifted 0.0015 by step 3 and
    0.0029 by step 7."""
    seed = torch.seed() % 2**31  # fresh inputs every run (apex: 9876)
    torch.manual_seed(seed)
    tensor = torch.rand(278011, dtype=param_type)
    ref_param, tst_param = [nn.Parameter(tensor.clone())], [nn.Parameter(tensor.clone())]
    ref_optim = torch.optim.SGD(ref_param, lr=0.25, momentum=0.125)
    tst_optim = FusedSGD(tst_param, lr=0.25, momentum=0.125)
    for i in range(7):
        for p_ref, p_tst in zip(ref_param, tst_param):
            p_ref.grad = torch.rand_like(p_ref)
            p_tst.grad = p_ref.grad
        ref_optim.step()
        tst_optim.step()
        max_abs_diff, max_rel_diff = _max_diff(ref_param, tst_param)
        assert max_abs_diff <= 1e-3, (i, max_abs_diff, f"seed {seed}")
        assert max_rel_diff <= 1, (i, max_rel_diff, f"seed {seed}")


class _Model(nn.Module):
    """apex's test model (LeNet-like)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.relu1, self.pool1 = nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.relu2, self.pool2 = nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)
        self.fc1, self.relu3 = nn.Linear(256, 120), nn.ReLU()
        self.fc2, self.relu4 = nn.Linear(120, 84), nn.ReLU()
        self.fc3, self.relu5 = nn.Linear(84, 10), nn.ReLU()

    def forward(self, x):
        y = self.pool1(self.relu1(self.conv1(x)))
        y = self.pool2(self.relu2(self.conv2(y)))
        y = y.reshape(y.shape[0], -1)
        return self.relu5(self.fc3(self.relu4(self.fc2(self.relu3(self.fc1(y))))))


LR = 1e-5
GRAD_SCALER_CASES = {  # the fused optimizer, and torch's with the same semantics (None: compare grads only)
    "adam": (lambda ps: FusedAdam(ps, lr=LR, adam_w_mode=False), lambda ps: torch.optim.Adam(ps, lr=LR)),
    "sgd": (lambda ps: FusedSGD(ps, lr=LR * 100, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=LR * 100,
                                                                                            momentum=0.9)),
    "adadelta": (lambda ps: FusedAdadelta(ps), lambda ps: torch.optim.Adadelta(ps)),
    "lamb": (lambda ps: FusedLAMB(ps, lr=LR), None),
}


@pytest.mark.parametrize("name", list(GRAD_SCALER_CASES))
def test_grad_scaler_leaves_unscaled_grads(name, path):
    """AdamTest.testGradScaler (autocast: CPU bfloat16 instead of CUDA float16; the scaler's 65536 either way)."""
    make_fused, make_torch = GRAD_SCALER_CASES[name]
    seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    model, model_ = _Model(), _Model()
    model_.load_state_dict(copy.deepcopy(model.state_dict()))
    optimizer = (make_torch or (lambda ps: torch.optim.Adam(ps, lr=LR)))(list(model.parameters()))
    optimizer_ = make_fused(list(model_.parameters()))
    scaler, scaler_ = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for i in range(5):
        x = torch.rand([32, 1, 28, 28]).to(memory_format=torch.channels_last)
        gt = torch.rand([32, 10])
        for m, opt, sc in ((model, optimizer, scaler), (model_, optimizer_, scaler_)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ((gt - m(x)) ** 2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        assert scaler_.get_scale() == 65536.0  # the grads the step got were scaled 2^16
        for m, m_ in zip(model.modules(), model_.modules()):
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                if make_torch is not None:
                    torch.testing.assert_close(m.weight, m_.weight, atol=1e-3, rtol=1e-3, equal_nan=True)
                torch.testing.assert_close(m.weight.grad, m_.weight.grad, atol=1e-3, rtol=1e-3, equal_nan=True,
                                           msg=lambda s: f"step {i} grad, seed {seed}: {s}")
        optimizer.zero_grad()
        optimizer_.zero_grad()
        model_.load_state_dict(copy.deepcopy(model.state_dict()))


MAKERS = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-3),
    "adam_master": lambda ps: FusedAdam(ps, lr=1e-3, master_weights=True),
    "sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
    "adadelta": lambda ps: FusedAdadelta(ps),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MAKERS))
def test_grads_after_an_in_kernel_step_are_torch_fused_adams(name, dtype, path):
    """grad_scale/found_inf as GradScaler hands them (the attributes): a clean step leaves each grad divided
    by the scale in its own dtype, a skipped one leaves it as it was, exactly as ``torch.optim.Adam(fused=True)``
    does to its grads on the same tensors."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    shapes = [(1,), (33,), (1000,), (7, 13)]
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = MAKERS[name](params), torch.optim.Adam(ref, lr=1e-3, fused=True)
    for found in (0.0, 1.0, 0.0):
        grads = [torch.randn(s, generator=gen).to(dtype) * 65536 for s in shapes]
        for p, q, g in zip(params, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        for o in (opt, ref_opt):
            o.grad_scale, o.found_inf = torch.tensor(65536.0), torch.tensor(found)
            o.step()
            del o.grad_scale, o.found_inf
        for p, q, g in zip(params, ref, grads):
            assert torch.equal(p.grad, q.grad), (found, (p.grad - q.grad).abs().max())
            assert torch.equal(p.grad, g if found else (g.float() / 65536).to(dtype)), found


def test_a_non_contiguous_grad_is_left_unscaled_too(path):
    """The kernels read dense grads: a transposed one is handed over as a copy, whose unscaled values must
    reach ``p.grad`` all the same."""
    param = torch.randn(5, 7, requires_grad=True)
    grad = torch.randn(7, 5)
    param.grad = grad.t() * 1024
    assert not param.grad.is_contiguous()
    FusedAdam([param], lr=1e-3).step(grad_scale=torch.tensor(1024.0))
    assert torch.equal(param.grad, grad.t())
