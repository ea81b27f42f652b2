"""What lightning_amp.ops relies on in torch's private fused kernels (docs/architecture.md, "torch and Lightning
internals"): ``torch._fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` divide the grads by ``grad_scale`` and
write them back unscaled, skip everything (grads included) when ``found_inf`` is 1.0 and read the step
counters as given; ``torch._foreach_norm`` takes ``dtype=torch.float32`` for 16-bit tensors. Each fails the
day a torch release changes one of these."""
import pytest
import torch

DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.cuda)] * torch.cuda.is_available()


def _lists(n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in (3, 1000, 4099)] for _ in range(n)]


def _adam(kernel, params, grads, m, v, steps, scale, found):
    kernel(params, grads, m, v, [], steps, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
           amsgrad=False, maximize=False, grad_scale=scale, found_inf=found)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["_fused_adamw_", "_fused_adam_"])
def test_fused_adam_unscales_grads_in_place_and_skips_on_the_flag(name, dtype, device):
    kernel = getattr(torch, name)
    params, unscaled, m, v = _lists(4, dtype, device, 0)
    v = [t.abs() for t in v]
    grads = [g * 1024 for g in unscaled]
    steps = [torch.full((), 3.0, device=device) for _ in params]
    before = [t.clone() for t in params + grads + m + v + steps]
    one = torch.tensor(1.0, device=device)
    _adam(kernel, params, grads, m, v, steps, torch.tensor(1024.0, device=device), one)
    assert all(torch.equal(a, b) for a, b in zip(before, params + grads + m + v + steps)), "a skipped step wrote"
    _adam(kernel, params, grads, m, v, steps, torch.tensor(1024.0, device=device), torch.zeros((), device=device))
    assert all(torch.equal(g, u) for g, u in zip(grads, unscaled)), "grads not written back unscaled"
    assert all(s.item() == 3.0 for s in steps), "the kernel advanced the step counters itself"
    # the step read as given: bias corrections of step 3 (the reference: torch.optim's single-tensor loop)
    ref_p, _, ref_m, ref_v = _lists(4, dtype, device, 0)
    ref_v = [t.abs() for t in ref_v]
    opt_cls = torch.optim.AdamW if name == "_fused_adamw_" else torch.optim.Adam
    ref = [torch.nn.Parameter(p.float()) for p in ref_p]
    opt = opt_cls(ref, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8, foreach=False)
    for p, g, mm, vv in zip(ref, unscaled, ref_m, ref_v):
        p.grad = g.float()
        opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": mm.float().cpu(), "exp_avg_sq": vv.float().cpu()}
    opt.step()
    tol = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for p, r in zip(params, ref):
        assert ((p.float() - r).abs() <= tol * r.abs().clamp_min(1)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_sgd_unscales_grads_in_place_and_skips_on_the_flag(device):
    params, unscaled, bufs = _lists(3, torch.float32, device, 1)
    grads = [g * 1024 for g in unscaled]
    before = [t.clone() for t in params + grads + bufs]

    def step(found, first):
        torch._fused_sgd_(params, grads, bufs, weight_decay=0.1, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False,
                          maximize=False, is_first_step=first, grad_scale=torch.tensor(1024.0, device=device),
                          found_inf=torch.tensor(found, device=device))

    step(1.0, True)
    assert all(torch.equal(a, b) for a, b in zip(before, params + grads + bufs)), "a skipped step wrote"
    step(0.0, True)
    assert all(torch.equal(g, u) for g, u in zip(grads, unscaled)), "grads not written back unscaled"
    for p0, p, g, b in zip(before, params, unscaled, bufs):
        d = g + 0.1 * p0
        assert torch.allclose(b, d, rtol=1e-6, atol=1e-7), "is_first_step: the buffer is the decayed grad"
        assert torch.allclose(p, p0 - 0.1 * d, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_foreach_norm_takes_an_fp32_result_dtype(device):
    tensors = [t.bfloat16() for t in _lists(1, torch.float32, device, 2)[0]]
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    for n, t in zip(norms, tensors):
        ref = torch.linalg.vector_norm(t.double())
        assert n.dtype == torch.float32 and abs(n.item() - ref.item()) <= 1e-6 * ref.item()
