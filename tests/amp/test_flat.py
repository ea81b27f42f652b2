"""FlatGradBuffer: grads as views into one flat buffer per (device, dtype)."""
from __future__ import annotations

import pytest
import torch

from lightning_amp import FusedAdam
from lightning_amp.amp.flat import FlatGradBuffer


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    model[2].to(torch.bfloat16)
    return model


def _loss(model, x):
    h = model[1](model[0](x))
    return model[2](h.bfloat16()).float().square().mean()


def test_grads_are_views_and_accumulate_like_plain_autograd():
    model, ref = _model(), _model()
    flat = FlatGradBuffer(model.parameters())
    assert set(flat.buffers) == {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.bfloat16)}
    assert flat.buffers[(torch.device("cpu"), torch.float32)].numel() == 7 * 33 + 33
    assert flat.views_intact()
    x = torch.randn(9, 7)
    for _ in range(2):  # two micro-batches accumulate in place
        _loss(model, x).backward()
        _loss(ref, x).backward()
    assert flat.views_intact()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)
    concat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.dtype == torch.float32])
    assert torch.equal(flat.buffers[(torch.device("cpu"), torch.float32)], concat)


def test_unscale_and_norm_over_the_buffers():
    model = _model()
    flat = FlatGradBuffer(model.parameters())
    _loss(model, torch.randn(4, 7)).backward()
    grads = [p.grad.double().clone() for p in model.parameters()]
    expected = torch.sqrt(sum((g ** 2).sum() for g in grads))
    assert torch.allclose(flat.norm().double(), expected, rtol=1e-5)
    found = flat.unscale_(4.0)
    assert found.item() == 0.0
    for p, g in zip(model.parameters(), grads):
        assert torch.allclose(p.grad.double(), g / 4.0, rtol=1e-6)
    model[0].weight.grad[0, 0] = float("inf")
    assert flat.unscale_(2.0).item() == 1.0


def test_zero_keeps_views_and_rebind_recovers_replaced_grads():
    model = _model()
    flat = FlatGradBuffer(model.parameters())
    opt = FusedAdam(model.parameters(), lr=1e-3)
    opt.attach_flat_grads(flat)
    _loss(model, torch.randn(3, 7)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # zeroes in place: the views survive
    assert flat.views_intact() and all(torch.count_nonzero(b) == 0 for b in flat.buffers.values())
    w = model[0].weight
    w.grad = torch.full_like(w, 3.0)  # someone replaced a grad
    assert not flat.views_intact()
    flat.rebind()
    assert flat.views_intact() and torch.all(w.grad == 3.0)
    start = (7 * 33)  # weight slice comes first in the fp32 buffer
    assert torch.all(flat.buffers[(torch.device("cpu"), torch.float32)][:start] == 3.0)
    model[0].bias.grad = None
    flat.zero_()
    assert flat.views_intact()


def test_bad_arguments():
    with pytest.raises(TypeError, match="params\\[1\\]"):
        FlatGradBuffer([torch.zeros(2, requires_grad=True), "x"])
    with pytest.raises(TypeError, match="FlatGradBuffer"):
        FusedAdam([torch.zeros(2, requires_grad=True)]).attach_flat_grads(object())
