"""Fused optimizers vs torch references (and an fp64 apex-LAMB reference), on the compiled
extension and on the pure-PyTorch fallback."""
from __future__ import annotations

import copy

import pytest
import torch

from lightning_amp import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD, ops

SIZES = [(1,), (7,), (33,), (1000,), (17, 31), (3, 5, 7)]
U = 2.0 ** -24  # fp32's unit roundoff

# fp32 results of two implementations of the same update from the same stored values: each is a chain of about n
# roundings, each relative to the magnitudes of its terms, so they lie within 2 n u of max|y| whatever the order
# of operations or the use of FMA (ATen's vector width, ATEN_CPU_CAPABILITY=default's scalar loops). n: Adam and
# SGD ~16 (decay, moments, sqrt, eps, quotient, step size); Adadelta squares its update into acc_delta, doubling
# the chain (2.9e-6 = 48 u measured with ATen's loops scalar). A skipped write moves results by ~1e-3 or more.
FP32_ROUNDINGS = {"adam": 16, "adam_master": 16, "sgd": 16, "adadelta": 32}
ROUNDINGS_OF = {FusedAdam: 16, FusedSGD: 16, FusedAdadelta: 32}  # the same, by class



def _params(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in sizes]


def _groups(params, lrs, wds):
    """Split ``params`` into len(lrs) groups with their own lr and weight_decay."""
    k = len(lrs)
    return [{"params": params[i::k], "lr": lrs[i], "weight_decay": wds[i]} for i in range(k)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone().to(p.dtype)


CASES = {
    "adamw": (FusedAdam, dict(), torch.optim.AdamW, dict()),
    "adam_l2_amsgrad": (FusedAdam, dict(adam_w_mode=False, amsgrad=True), torch.optim.Adam, dict(amsgrad=True)),
    "adamw_betas_eps": (FusedAdam, dict(betas=(0.8, 0.99), eps=1e-6), torch.optim.AdamW,
                        dict(betas=(0.8, 0.99), eps=1e-6)),
    "sgd_momentum": (FusedSGD, dict(momentum=0.9, dampening=0.2), torch.optim.SGD, dict(momentum=0.9, dampening=0.2)),
    "sgd_nesterov": (FusedSGD, dict(momentum=0.8, nesterov=True), torch.optim.SGD, dict(momentum=0.8, nesterov=True)),
    "sgd_plain": (FusedSGD, dict(), torch.optim.SGD, dict()),
    "adadelta": (FusedAdadelta, dict(rho=0.85, eps=1e-5), torch.optim.Adadelta, dict(rho=0.85, eps=1e-5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_reference_100_steps_fp32(case, path):
    fused_cls, fkw, ref_cls, rkw = CASES[case]
    init = _params(SIZES, seed=1)
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    lrs, wds = [1e-2, 3e-3, 5e-2], [0.0, 0.1, 0.01]
    if fused_cls is FusedAdadelta:
        lrs = [1.0, 0.5, 2.0]
    opt = fused_cls(_groups(ours, lrs, wds), **fkw)
    ref_opt = ref_cls(_groups(ref, lrs, wds), **rkw, foreach=False)
    gen = torch.Generator().manual_seed(2)
    # each step from the same stored values (ours set to the reference's after the comparison): one step of two
    # implementations of the same fp32 math, each result a chain of n roundings relative to the magnitudes of its
    # terms (the value before the step and the grad, both bounded by ``size``), so within 2 n u of them on any CPU
    # (FP32_ROUNDINGS); a wrong coefficient, a group's lr or weight decay ignored (>= 5e-4 of the param a step) or a
    # bias correction one step off (the first update doubled) shows
    bound = 2 * ROUNDINGS_OF[fused_cls] * U
    for _ in range(100):
        grads = [torch.randn(p.shape, generator=gen) for p in init]
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        before = [(b.detach().clone(), {k: v.clone() for k, v in ref_opt.state[b].items() if torch.is_tensor(v)})
                  for b in ref]
        opt.step()
        ref_opt.step()
        for a, b, g, (b0, st0) in zip(ours, ref, grads, before):
            size = max(b.abs().max(), b0.abs().max(), g.abs().max())
            assert (a - b).abs().max() <= bound * size
            for key, value in ref_opt.state[b].items():
                if value is not None and key != "step":
                    size = max(value.abs().max(), st0.get(key, value).abs().max(), g.abs().max())
                    assert (opt.state[a][key] - value).abs().max() <= bound * size, key
            with torch.no_grad():
                a.copy_(b)
                for key, value in ref_opt.state[b].items():
                    if value is not None and key != "step":
                        opt.state[a][key].copy_(value)
    for a, b, a0 in zip(ours, ref, init):
        assert not torch.equal(a, a0)  # every group moved
        if "step" in ref_opt.state[b]:
            assert float(opt.state[a]["step"]) == float(ref_opt.state[b]["step"]) == 100.0


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance (fp32) from each element of the 16-bit tensor ``x`` to its farther representable neighbour:
    an exact value that lies within half of this of ``x`` rounds to ``x`` (one rounding, ties aside)."""
    up = torch.nextafter(x, torch.full_like(x, float("inf"))).float()
    down = torch.nextafter(x, torch.full_like(x, float("-inf"))).float()
    return torch.maximum(up - x.float(), x.float() - down)


def _assert_rounded_once(actual: torch.Tensor, exact: torch.Tensor, what: str, roundings: int) -> None:
    """``actual`` (fp32/bf16/fp16) is the fp32 ``exact`` rounded once to its dtype: within half a spacing
    (plus ``2 * roundings * u`` of the tensor's largest value: two implementations of a chain of that many fp32
    roundings, in another order or with FMA, see FP32_ROUNDINGS); fp32 ``actual`` within that slack. The slack
    (<= 4e-6 of max|exact|) is far below the updates these tests look for (~1e-2)."""
    exact = exact.float()
    fp32_slack = 2 * roundings * U * exact.abs().max() + 1e-30
    if actual.dtype == torch.float32:
        bound = fp32_slack
    else:
        bound = 0.5 * _spacing(actual) + fp32_slack
    excess = (actual.float() - exact).abs() - bound
    assert excess.max() <= 0, f"{what}: off by more than one rounding (worst excess {excess.max().item():.3g})"


def _reference_step(ref_cls, rkw, group, p, grad, state):
    """One step of the torch optimizer in fp32 from ``p``'s current (possibly 16-bit) values and state."""
    r = p.detach().float().clone().requires_grad_()
    r.grad = grad.float()
    ref_opt = ref_cls([{"params": [r], "lr": group["lr"], "weight_decay": group["weight_decay"]}], **rkw,
                      foreach=False)
    if state:
        ref_opt.state[r] = {k: v.clone() if k == "step" else v.float().clone() for k, v in state.items()}
    ref_opt.step()
    return r.detach(), ref_opt.state[r]


@pytest.mark.parametrize("fused_cls,fkw,ref_cls,rkw", [
    (FusedAdam, {}, torch.optim.AdamW, {}),
    (FusedAdam, dict(adam_w_mode=False, amsgrad=True), torch.optim.Adam, dict(amsgrad=True)),
    (FusedSGD, dict(momentum=0.9), torch.optim.SGD, dict(momentum=0.9)),
    (FusedAdadelta, {}, torch.optim.Adadelta, {}),
], ids=["adamw", "adam_amsgrad", "sgd", "adadelta"])
def test_mixed_dtypes_in_one_group(fused_cls, fkw, ref_cls, rkw, path):
    """Each step, every param (fp32, bf16, fp16 in one group; fp32 math inside) and every state tensor is
    the fp32 torch step from the same stored (rounded) values, rounded once to the param's dtype (SGD's
    param: updated with the momentum buffer as stored, in the param's dtype, as ``torch.optim.SGD`` does).

    Parameters of size ~1 get updates of ~lr = 1e-2 (Adam) per step, larger than half a bf16/fp16
    spacing, so a kernel that skipped writing a 16-bit param or its state fails (checked below too)."""
    init = _params([(33,), (7, 9), (1000,), (5,)], seed=3)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    ours = [p.to(d).requires_grad_() for p, d in zip(init, dtypes)]
    lr = 1.0 if fused_cls is FusedAdadelta else 1e-2
    opt = fused_cls([{"params": ours, "lr": lr, "weight_decay": 0.05}], **fkw)
    group = opt.param_groups[0]
    gen = torch.Generator().manual_seed(4)
    visible = []
    for step in range(20):
        grads = [torch.randn(p.shape, generator=gen) for p in init]
        _set_grads(ours, grads)
        before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in ours]
        expected = [_reference_step(ref_cls, rkw, group, p0, p.grad, st0) for p, (p0, st0) in zip(ours, before)]
        if fused_cls is FusedSGD:
            expected = [(p0.float() - lr * st["momentum_buffer"].to(p0.dtype).float(), st)
                        for (p0, _), (_, st) in zip(before, expected)]
        opt.step()
        for i, (p, (p0, _), (ref_p, ref_state)) in enumerate(zip(ours, before, expected)):
            assert p.dtype == dtypes[i]
            _assert_rounded_once(p.detach(), ref_p, f"step {step} param {i} ({p.dtype})", ROUNDINGS_OF[fused_cls])
            if p.dtype != torch.float32:
                visible.append(((ref_p - p0.float()).abs() > _spacing(p0)).float().mean().item())
            for key, value in ref_state.items():
                if key == "step":
                    assert float(opt.state[p]["step"]) == float(value) == step + 1
                else:
                    assert opt.state[p][key].dtype == p.dtype, key
                    _assert_rounded_once(opt.state[p][key], value, f"step {step} param {i} state {key}",
                                         ROUNDINGS_OF[fused_cls])
    # the test's power: most 16-bit updates are larger than a spacing, so a missing write shows
    assert sum(visible) / len(visible) > 0.3, visible


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_master_weights(half, adam_w_mode, path):
    """Masters follow an fp32 AdamW/Adam fed the same (16-bit) grads; the model copy is the master rounded."""
    init = _params(SIZES, seed=5)
    model = [p.to(half).requires_grad_() for p in init]
    ref = [p.to(half).float().requires_grad_() for p in init]
    opt = FusedAdam(_groups(model, [1e-3, 4e-3], [0.01, 0.1]), master_weights=True, adam_w_mode=adam_w_mode)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = ref_cls(_groups(ref, [1e-3, 4e-3], [0.01, 0.1]), foreach=False)
    gen = torch.Generator().manual_seed(6)
    for _ in range(100):
        grads = [torch.randn(p.shape, generator=gen).to(half) for p in init]
        _set_grads(model, grads)
        _set_grads(ref, [g.float() for g in grads])
        opt.step()
        ref_opt.step()
        for p, r in zip(model, ref):  # each step from the same stored values: within 2 n u (FP32_ROUNDINGS)
            st = opt.state[p]
            master = st["master_param"]
            assert master.dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
            assert _rel(master, r) < 2 * FP32_ROUNDINGS["adam_master"] * U
            assert torch.equal(p.detach(), master.to(half))  # the copy is the master rounded: the same conversion
            with torch.no_grad():
                master.copy_(r)
                for key in ("exp_avg", "exp_avg_sq"):
                    st[key].copy_(ref_opt.state[r][key])


MAKERS = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.1),
    "adam_master": lambda ps: FusedAdam(ps, lr=1e-3, master_weights=True),
    "sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
    "adadelta": lambda ps: FusedAdadelta(ps, weight_decay=0.1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MAKERS))
def test_extension_matches_fallback(name, dtype, monkeypatch):
    """The compiled kernels and the pure-PyTorch fallback agree on awkward sizes up to ~1M elements: each
    step starts both from the same stored values, so each result is one rounding of the same fp32 math."""
    if ops.backend("cpu") != "cpu-ext":
        pytest.skip("compiled extension not built")
    init = _params([(1,), (7,), (33,), (1000,), (5, 7, 3), ((1 << 20) + 3,)], dtype=dtype, seed=17)
    a = [p.clone().requires_grad_() for p in init]
    b = [p.clone().requires_grad_() for p in init]
    oa, ob = MAKERS[name](a), MAKERS[name](b)
    gen = torch.Generator().manual_seed(18)
    # LAMB: every element moves by +-lr * trust ratio at first, landing at one offset from the bf16 grid
    # across a binade, so its roundings straddle together (1.4% of 1M elements observed); and the compiled
    # kernel's second pass recomputes the update from the stored, 16-bit-rounded moments (the fallback
    # keeps them in fp32): a relative difference of the update of ~1.5 * 2**-9 (m, sqrt(v)); bound 2**-7
    lamb = name == "lamb"
    fp32_rtol, ties = (1e-4, 0.05) if lamb else (2 * FP32_ROUNDINGS[name] * U, 1e-3)
    for i in range(3):
        before = [y.detach().float() for y in b]
        state_before = [{k: v.float().clone() for k, v in ob.state[y].items()} for y in b]
        grads = [torch.randn(p.shape, generator=gen).to(dtype) * 8 for p in init]
        _set_grads(a, grads)
        _set_grads(b, grads)
        oa.step(grad_scale=torch.tensor(8.0))
        with monkeypatch.context() as m:
            m.setattr(ops._ext, "_EXT", None)
            ob.step(grad_scale=torch.tensor(8.0))
        for x, y, y0, st0, g in zip(a, b, before, state_before, grads):
            # the terms of each chain: the value before the step and the (unscaled) grad; a 1-element momentum
            # buffer that cancels to 1e-2 carries roundings of terms ~1 (722 u of |y| seen on an AVX2 EPYC)
            g_size = g.float().abs().max() / 8
            _assert_same_rounding(x.detach(), y.detach(), f"step {i} param", fp32_rtol, ties,
                                  2**-7 * (y.detach().float() - y0).abs() if lamb else 0.0,
                                  size=max(y0.abs().max(), g_size))
            for key, value in ob.state[y].items():
                size = max(st0[key].abs().max(), g_size) if key in st0 else g_size
                _assert_same_rounding(oa.state[x][key], value, f"step {i} {key}", fp32_rtol, ties, size=size)
            with torch.no_grad():  # the next step starts both from the same values again
                y.copy_(x)
                for key, value in ob.state[y].items():
                    value.copy_(oa.state[x][key])


def _assert_same_rounding(x: torch.Tensor, y: torch.Tensor, what: str, fp32_rtol: float,
                          tie_fraction: float = 1e-3, slack: float | torch.Tensor = 0.0,
                          size: float | torch.Tensor = 0.0) -> None:
    """Two implementations of the same fp32 math from the same stored values, each rounding once to
    ``x.dtype``.

    fp32 results agree to ``fp32_rtol`` of max(max|y|, ``size``), ``size`` the largest term the results were
    computed from, which exceeds max|y| where they cancel (summation order: LAMB's global norm over 1M elements
    differs by ~4e-5 between a blocked and a per-tensor sum). 16-bit results are equal except where the
    two fp32 values straddle a rounding boundary, then one spacing apart (plus ``fp32_rtol`` of max|y| for
    results that cancel); at most ``tie_fraction`` of the
    elements (plus 3) may do so. A kernel that skipped a write differs by its update (~1e-3..1e-2
    relative, 0.5-5 spacings) in most elements of the 1M-element tensor. ``slack``: an extra
    per-element bound where the two are known to round an intermediate differently."""
    assert x.dtype == y.dtype, what
    scale = max(y.float().abs().max(), size)
    if x.dtype == torch.float32:
        assert (x - y).abs().max() <= fp32_rtol * scale, what
        return
    differ = x != y
    assert differ.sum() <= 3 + tie_fraction * x.numel(), f"{what}: {int(differ.sum())} of {x.numel()} elements differ"
    spacing = torch.maximum(_spacing(x), _spacing(y))
    bad = (x.float() - y.float()).abs() > spacing + slack + fp32_rtol * scale
    assert not bad.any(), f"{what}: {x[bad][:4].tolist()} vs {y[bad][:4].tolist()}: more than one spacing apart"


def _lamb_reference_fp64(groups, grads_per_step, *, betas, eps, bias_correction, grad_averaging, adam_w_mode,
                         max_grad_norm, use_nvlamb):
    """apex FusedLAMB's algorithm in fp64 (written from its description, independent of the op)."""
    beta1, beta2 = betas
    params = [[p.double().clone() for p in g["params"]] for g in groups]
    m = [[torch.zeros_like(p) for p in ps] for ps in params]
    v = [[torch.zeros_like(p) for p in ps] for ps in params]
    for step, grads in enumerate(grads_per_step, start=1):
        gnorm = torch.sqrt(sum((g.double() ** 2).sum() for gs in grads for g in gs)).item()
        clip = gnorm / max_grad_norm if gnorm > max_grad_norm else 1.0
        for gi, group in enumerate(groups):
            lr, wd = group["lr"], group["weight_decay"]
            c1 = 1 - beta1**step if bias_correction else 1.0
            c2 = 1 - beta2**step if bias_correction else 1.0
            b3 = 1 - beta1 if grad_averaging else 1.0
            for i, p in enumerate(params[gi]):
                g = grads[gi][i].double() / clip
                if not adam_w_mode:
                    g = g + wd * p
                m[gi][i] = beta1 * m[gi][i] + b3 * g
                v[gi][i] = beta2 * v[gi][i] + (1 - beta2) * g * g
                u = (m[gi][i] / c1) / ((v[gi][i] / c2).sqrt() + eps)
                if adam_w_mode:
                    u = u + wd * p
                ratio = 1.0
                if wd != 0 or use_nvlamb:
                    pn, un = p.norm().item(), u.norm().item()
                    if pn != 0 and un != 0:
                        ratio = pn / un
                params[gi][i] = p - lr * ratio * u
    return params


@pytest.mark.parametrize("kw", [
    dict(),
    dict(adam_w_mode=False, grad_averaging=False, max_grad_norm=5.0),
    dict(use_nvlamb=True, bias_correction=False, max_grad_norm=100.0),
])
def test_lamb_matches_fp64_apex_reference(kw, path):
    init = _params(SIZES, seed=7)
    ours = [p.clone().requires_grad_() for p in init]
    groups = _groups(ours, [1e-2, 3e-3], [0.01, 0.0])
    opt = FusedLAMB(groups, betas=(0.9, 0.99), eps=1e-6, **kw)
    ref_groups = _groups(init, [1e-2, 3e-3], [0.01, 0.0])
    gen = torch.Generator().manual_seed(8)
    history = []
    for _ in range(100):
        grads = [[torch.randn(p.shape, generator=gen) * 0.3 for p in g["params"]] for g in groups]
        history.append(grads)
        for g, gs in zip(groups, grads):
            _set_grads(g["params"], gs)
        opt.step()
    full = dict(bias_correction=True, grad_averaging=True, adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False)
    full.update(kw)
    expected = _lamb_reference_fp64(ref_groups, history, betas=(0.9, 0.99), eps=1e-6, **full)
    for g, exp in zip(groups, expected):
        for p, e in zip(g["params"], exp):
            assert _rel(p, e) < 2e-5


def _lamb_run(pdtype, copies, reduce_norms, *, lr=1e-2, found_inf_at=None, n_steps=3):
    """``ops.multi_tensor_lamb`` steps (loss scale 8 divided out) on fresh lists; returns every tensor written."""
    gen = torch.Generator().manual_seed(31)
    params = [torch.randn(s, generator=gen).to(pdtype) for s in SIZES]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    model_copies = [p.to(torch.bfloat16) for p in params] if copies else None
    for step in range(n_steps):
        grads = [torch.randn(s, generator=gen).to(torch.bfloat16 if copies else pdtype) * 8 for s in SIZES]
        ops.multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=0.9, beta2=0.99, eps=1e-6,
                              weight_decay=0.01, global_grad_norm=torch.tensor(3.0), max_grad_norm=1.0,
                              grad_scale=torch.tensor(8.0), found_inf=torch.tensor(float(step == found_inf_at)),
                              model_copies=model_copies, reduce_norms=reduce_norms)
    return params + exp_avgs + exp_avg_sqs + steps + (model_copies or [])


@pytest.mark.parametrize("pdtype,copies", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "fp32-masters-bf16-copies"])
def test_lamb_two_passes_use_the_reduced_norms(pdtype, copies, path, monkeypatch):
    """With ``reduce_norms`` (sharded params) LAMB runs in two passes around it, on the compiled kernels when
    built: passed on unchanged, the squared norms give the one-call result bitwise; param norms summed over
    "4 shards" of equal norm (x4 squared) give the one-call result at twice the lr (trust ratio x2); with
    found_inf set nothing changes and the reduction still runs (every rank joins the all-reduce)."""
    if path.startswith("ext"):  # LAMB has no torch kernel: ours either way
        monkeypatch.setattr(ops.optim, "_lamb_fallback", lambda *a, **k: pytest.fail("sharded LAMB left the kernels"))
    calls = []

    def unchanged(squares):
        calls.append(squares.dtype)
        return squares.clone()

    one_call = _lamb_run(pdtype, copies, None)
    for a, b in zip(one_call, _lamb_run(pdtype, copies, unchanged)):
        assert torch.equal(a, b)
    assert calls == [torch.float64 if path.startswith("ext") else torch.float32] * 3
    doubled = _lamb_run(pdtype, copies, None, lr=2e-2)
    four_shards = _lamb_run(pdtype, copies, lambda sq: sq * torch.tensor([4.0, 1.0], dtype=sq.dtype))
    for a, b in zip(doubled, four_shards):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(one_call, doubled))
    calls.clear()
    skipped_last = _lamb_run(pdtype, copies, unchanged, found_inf_at=2)
    assert len(calls) == 3
    for a, b in zip(skipped_last, _lamb_run(pdtype, copies, None, n_steps=2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda sq: sq.float() if sq.dtype == torch.float64 else sq.double(), TypeError, "reduce_norms must return"),
    (lambda sq: sq[:-1], ValueError, "reduce_norms must return shape"),
    (lambda sq: None, TypeError, "reduce_norms must return"),
])
def test_lamb_refuses_a_bad_reduce_norms_answer(bad, exc, match, path):
    with pytest.raises(exc, match=match):
        _lamb_run(torch.float32, False, bad)


ALL = [
    lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda ps: FusedAdam(ps, lr=1e-2, master_weights=True),
    lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
    lambda ps: FusedLAMB(ps, lr=1e-2),
    lambda ps: FusedAdadelta(ps, weight_decay=0.1),
]
ALL_IDS = ["adam", "adam_master", "sgd", "lamb", "adadelta"]


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()["state"])


def _assert_same_snapshot(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert a[1][k].keys() == b[1][k].keys()
        for key in a[1][k]:
            assert torch.equal(a[1][k][key], b[1][k][key]), key


def _mixed_params(seed):
    init = _params([(33,), (1000,), (7, 3)], seed=seed)
    return [init[0].requires_grad_(), init[1].bfloat16().requires_grad_(), init[2].requires_grad_()]


@pytest.mark.parametrize("make", ALL, ids=ALL_IDS)
def test_found_inf_changes_nothing(make, path):
    params = _mixed_params(9)
    opt = make(params)
    gen = torch.Generator().manual_seed(10)
    # very first step skipped: no state is created
    _set_grads(params, [torch.randn(p.shape, generator=gen) for p in params])
    before = _snapshot(opt, params)
    opt.step(found_inf=torch.ones(()))
    _assert_same_snapshot(before, _snapshot(opt, params))
    for _ in range(3):
        _set_grads(params, [torch.randn(p.shape, generator=gen) for p in params])
        opt.step(found_inf=torch.zeros(()))
    before = _snapshot(opt, params)
    _set_grads(params, [torch.randn(p.shape, generator=gen) for p in params])
    opt.step(found_inf=torch.tensor(1.0), grad_scale=torch.tensor(4.0))
    _assert_same_snapshot(before, _snapshot(opt, params))
    opt.step()  # and a clean step then does change things
    assert not torch.equal(before[0][0], params[0].detach())


@pytest.mark.parametrize("make", ALL, ids=ALL_IDS)
def test_grad_scale_matches_unscaled_run(make, path):
    a, b = _mixed_params(11), _mixed_params(11)
    oa, ob = make(a), make(b)
    gen = torch.Generator().manual_seed(12)
    scale = 1024.0
    for i in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in a]
        _set_grads(a, grads)
        _set_grads(b, [g * scale for g in grads])
        oa.step()
        if i % 2:
            ob.step(grad_scale=torch.tensor(scale))
        else:  # the attribute protocol torch.amp.GradScaler uses
            ob.grad_scale, ob.found_inf = torch.tensor(scale), torch.tensor(0.0)
            ob.step()
            del ob.grad_scale, ob.found_inf
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_works_under_torch_grad_scaler(path):
    torch.manual_seed(13)
    model = torch.nn.Linear(7, 3)
    ref = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(4):
        x = torch.randn(5, 7)
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # 4 steps of two implementations of AdamW on grads of the same model: each step adds at most 2 n u of max|p|
    # (FP32_ROUNDINGS; the grads follow the params, which differ by that much); a missed unscale is 256x off
    for p, r in zip(model.parameters(), ref.parameters()):
        assert _rel(p, r) < 4 * 2 * FP32_ROUNDINGS["adam"] * U
    assert not hasattr(opt, "grad_scale")


@pytest.mark.parametrize("make", ALL, ids=ALL_IDS)
def test_state_dict_round_trip_continues_identically(make, path):
    a = _mixed_params(14)
    oa = make(a)
    gen = torch.Generator().manual_seed(15)
    for _ in range(4):
        _set_grads(a, [torch.randn(p.shape, generator=gen) for p in a])
        oa.step()
    b = [p.detach().clone().requires_grad_() for p in a]
    ob = make(b)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    for p, q in zip(a, b):
        for key, value in oa.state[p].items():
            assert ob.state[q][key].dtype == value.dtype and torch.equal(ob.state[q][key], value), key
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen) for p in a]
        _set_grads(a, grads)
        _set_grads(b, grads)
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_master_weights_survive_checkpoint_in_fp32(path):
    params = [torch.randn(100).bfloat16().requires_grad_()]
    opt = FusedAdam(params, lr=1e-4, master_weights=True)
    params[0].grad = torch.randn(100).bfloat16()
    opt.step()
    master = opt.state[params[0]]["master_param"].clone()
    assert not torch.equal(master, master.bfloat16().float())  # the master holds bits bf16 lacks
    opt2 = FusedAdam([params[0].detach().clone().requires_grad_()], lr=1e-4, master_weights=True)
    opt2.load_state_dict(opt.state_dict())
    loaded = next(iter(opt2.state.values()))["master_param"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, master)


@pytest.mark.parametrize("make", ALL, ids=ALL_IDS)
def test_closure_and_zero_grad(make, path):
    torch.manual_seed(16)
    model = torch.nn.Linear(4, 2)
    opt = make(list(model.parameters()))
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        return loss

    w0 = model.weight.detach().clone()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(w0, model.weight)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # no grads: nothing to do, no error


def test_params_without_grad_are_left_alone(path):
    a, b = torch.randn(5, requires_grad=True), torch.randn(6, requires_grad=True)
    b0 = b.detach().clone()
    opt = FusedAdam([a, b], lr=0.1)
    a.grad = torch.randn(5)
    opt.step()
    assert torch.equal(b, b0) and len(opt.state[b]) == 0


@pytest.mark.parametrize("make,match", [
    (lambda p: FusedAdam(p, lr=-1.0), "lr"),
    (lambda p: FusedAdam(p, betas=(1.0, 0.9)), "betas"),
    (lambda p: FusedAdam(p, betas=(0.9, -0.1)), "betas"),
    (lambda p: FusedAdam(p, eps=-1e-8), "eps"),
    (lambda p: FusedAdam(p, weight_decay=-0.1), "weight_decay"),
    (lambda p: FusedAdam([{"params": p, "lr": -2.0}]), "lr"),
    (lambda p: FusedSGD(p), "lr"),
    (lambda p: FusedSGD(p, lr=0.1, momentum=-0.5), "momentum"),
    (lambda p: FusedSGD(p, lr=0.1, nesterov=True), "nesterov"),
    (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov"),
    (lambda p: FusedLAMB(p, max_grad_norm=-1.0), "max_grad_norm"),
    (lambda p: FusedLAMB(p, betas=(0.9, 1.5)), "betas"),
    (lambda p: FusedAdadelta(p, rho=1.5), "rho"),
    (lambda p: FusedAdadelta(p, lr=-1.0), "lr"),
])
def test_bad_hyper_parameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.randn(3, requires_grad=True)])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64])
@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedLAMB, FusedAdadelta])
def test_non_supported_param_dtypes_rejected(cls, dtype):
    """Integer (and bool, float64) tensors are refused at construction, naming the allowed dtypes."""
    param = torch.arange(3).to(dtype)  # integer tensors cannot require grad; an optimizer still takes them
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        cls([param], lr=0.1)


def _adam_reference_fp64(init, grads_per_step, *, lr, betas, eps, weight_decay, adam_w_mode, bias_correction,
                         amsgrad=False, eps_inside_correction=False, step_offset=0):
    """Adam(W) in fp64 as ``torch.optim.Adam``/``AdamW`` compute it (``bias_correction=False``: without the
    corrections, which torch lacks): ``p *= 1 - lr * wd`` (AdamW) or ``g += wd * p`` (Adam), the moments,
    ``p -= lr / c1 * m / (sqrt(v_max or v) / sqrt(c2) + eps)`` with the corrections of step ``t``.
    ``eps_inside_correction`` (``(sqrt(v) + eps) / sqrt(c2)``, apex's placement) and ``step_offset`` (corrections
    of step ``t + offset``) are the bugs a test must be able to see.

    Returns ``(params, budgets)``: per element, the rounding budget of an fp32 implementation after these
    steps, ``eps32 * sum_t(|p_t| + 8 * lr / c1 * |m|_t / denom_t)``: each step rounds the param about twice
    (decay, update: <= eps32 * |p_t|) and forms the update through ~8 roundings (the moments' recurrences,
    sqrt, corrections, eps, quotient, step size), each relative to the magnitudes of the terms, so ``|m|_t``
    is the first moment of ``|g| (+ wd * |p|)``: where the grad and the L2 term cancel, the update is known
    only to that absolute precision, which Adam divides by ``denom`` (down to eps)."""
    beta1, beta2 = betas
    params = [p.double().clone() for p in init]
    m, v, vmax, mag, budgets = ([torch.zeros_like(p) for p in params] for _ in range(5))
    for step, grads in enumerate(grads_per_step, start=1):
        c1 = 1 - beta1 ** (step + step_offset) if bias_correction else 1.0
        c2 = 1 - beta2 ** (step + step_offset) if bias_correction else 1.0
        for i, p in enumerate(params):
            g = grads[i].double()
            size = g.abs()
            if adam_w_mode:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
                size = size + weight_decay * p.abs()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            mag[i] = beta1 * mag[i] + (1 - beta1) * size
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            vmax[i] = torch.maximum(vmax[i], v[i])
            second = (vmax[i] if amsgrad else v[i]).sqrt()
            denom = (second + eps) / c2**0.5 if eps_inside_correction else second / c2**0.5 + eps
            p.sub_(lr / c1 * m[i] / denom)
            budgets[i] += torch.finfo(torch.float32).eps * (p.abs() + 8 * lr / c1 * mag[i] / denom)
    return params, budgets


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_without_bias_correction_matches_fp64_reference(adam_w_mode, path):
    """``bias_correction=False`` (untested elsewhere): matches the fp64 algorithm, and differs from the
    bias-corrected run by far more than the tolerance (early steps are ~3x larger with correction)."""
    init = _params(SIZES, seed=21)
    hyper = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, adam_w_mode=adam_w_mode)
    ours = [p.clone().requires_grad_() for p in init]
    corrected = [p.clone().requires_grad_() for p in init]
    opt = FusedAdam(ours, bias_correction=False, **hyper)
    opt_corrected = FusedAdam(corrected, bias_correction=True, **hyper)
    gen = torch.Generator().manual_seed(22)
    history = []
    for _ in range(30):
        grads = [torch.randn(p.shape, generator=gen) for p in init]
        history.append(grads)
        _set_grads(ours, grads)
        _set_grads(corrected, grads)
        opt.step()
        opt_corrected.step()
    expected, budgets = _adam_reference_fp64(init, history, bias_correction=False, **hyper)
    for p, e, b, c in zip(ours, expected, budgets, corrected):
        assert ((p.double() - e).abs() <= b).all()
        assert _rel(c, e) > 1e-3


def _kernel_step_adam(params, *, lr, betas, eps, weight_decay, adam_w_mode, amsgrad):
    """torch's Adam/AdamW stepped by the precision plugins' kernel driver (what O0-O3 run)."""
    from lightning_amp.amp.kernel_step import KernelStep  # noqa: PLC0415

    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    torch_opt = cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
    kernel = KernelStep(torch_opt)

    def step():
        assert kernel.usable()
        kernel.step(lambda device: torch.zeros((), device=device))
    return step


def _torch_adam(params, *, lr, betas, eps, weight_decay, adam_w_mode, amsgrad):
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


ADAM_FP64_CASES = {
    "FusedAdam": (torch.float32, FusedAdam),
    "FusedAdam(master_weights, bf16)": (torch.bfloat16, lambda ps, **kw: FusedAdam(ps, master_weights=True, **kw)),
    "KernelStep(torch Adam)": (torch.float32, _kernel_step_adam),
    "torch Adam (the budget's sanity)": (torch.float32, _torch_adam),
}


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("case", list(ADAM_FP64_CASES))
def test_adam_matches_fp64_torch_formula_within_fp32_rounding(case, adam_w_mode, amsgrad, path):
    """20 steps of fresh random grads spanning 1e-7..1 (so eps = 1e-6 matters) with non-default lr, betas, eps
    and weight decay: every fp32 param (fp32 master for bf16 params) is within its fp32 rounding budget of the
    fp64 reference (see ``_adam_reference_fp64``; torch's own Adam meets it with the same margin, measured
    <= 0.3 of it over 12 seeds x every case). The budget is >= 10x smaller than what a wrong eps placement
    or a bias correction one step off (e.g. counting accumulation micro-steps) changes."""
    dtype, make = ADAM_FP64_CASES[case]
    seed = torch.seed() % 2**31  # fresh inputs every run
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in SIZES]
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ours = [p.clone().requires_grad_() for p in init]
    made = make(ours, amsgrad=amsgrad, **hyper)
    step = made.step if isinstance(made, torch.optim.Optimizer) else made
    history = []
    for _ in range(20):
        grads = [(torch.randn(s, generator=gen) * 10 ** torch.empty(s).uniform_(-7, 0, generator=gen)).to(dtype)
                 for s in SIZES]
        history.append(grads)
        _set_grads(ours, grads)
        step()
    got = [made.state[p]["master_param"] for p in ours] if dtype != torch.float32 else ours
    expected, budgets = _adam_reference_fp64(init, history, bias_correction=True, amsgrad=amsgrad, **hyper)
    for i, (p, e, b) in enumerate(zip(got, expected, budgets)):
        worst = ((p.double() - e).abs() / b).max().item()
        assert worst <= 1, f"{case} seed {seed}: param {i} off by {worst:.2f} of its fp32 rounding budget"
        if dtype != torch.float32:  # the model copy is the master rounded
            assert torch.equal(ours[i].detach(), p.to(dtype))
    for bug in (dict(eps_inside_correction=True), dict(step_offset=1)):  # the test's power
        wrong, _ = _adam_reference_fp64(init, history, bias_correction=True, amsgrad=amsgrad, **hyper, **bug)
        assert max(((w - e).abs() / b).max().item() for w, e, b in zip(wrong, expected, budgets)) > 10, bug


def _adam_lists(n=3, size=10, dtype=torch.float32):
    ps = [torch.randn(size, dtype=dtype) for _ in range(n)]
    return dict(params=ps, grads=[torch.randn_like(p) for p in ps], exp_avgs=[torch.zeros_like(p) for p in ps],
                exp_avg_sqs=[torch.zeros_like(p) for p in ps], steps=[torch.zeros(()) for _ in ps])


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a["grads"].pop(), ValueError, "equal length"),
    (lambda a: a["exp_avgs"].__setitem__(1, torch.zeros(10, dtype=torch.float16)), TypeError, "exp_avgs\\[1\\]"),
    (lambda a: a["grads"].__setitem__(2, torch.zeros(11)), ValueError, "grads\\[2\\]"),
    (lambda a: a["grads"].__setitem__(0, torch.zeros(10, device="meta")), ValueError, "grads\\[0\\]"),
    (lambda a: a["params"].__setitem__(1, torch.zeros(20)[::2]), ValueError, "contiguous"),
    (lambda a: a["params"].__setitem__(1, torch.zeros(10, dtype=torch.float64)), TypeError, "params\\[1\\]"),
    (lambda a: a["steps"].__setitem__(0, torch.zeros((), dtype=torch.int64)), TypeError, "steps\\[0\\]"),
])
def test_bad_kernel_arguments_raise(mutate, exc, match, path):
    args = _adam_lists()
    mutate(args)
    with pytest.raises(exc, match=match):
        ops.multi_tensor_adam(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def test_bad_flag_arguments_raise(path):
    args = _adam_lists()
    with pytest.raises(TypeError, match="grad_scale"):
        ops.multi_tensor_adam(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, grad_scale=torch.ones(2))
    with pytest.raises(TypeError, match="model_copies"):
        ops.multi_tensor_adam(**args, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              model_copies=[torch.zeros(10) for _ in range(3)])
    with pytest.raises(ValueError, match="momentum_buffers"):
        ops.multi_tensor_sgd(args["params"], args["grads"], None, lr=0.1, momentum=0.9)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MAKERS))
def test_cuda_kernels_match_cpu(name, dtype):
    """The CUDA multi-tensor kernels agree with the CPU path step by step (each step from the same stored
    values), incl. found_inf skipping on device."""
    init = _params([(1,), (7,), (33,), (1000,), (5, 7, 3), ((1 << 20) + 3,)], dtype=dtype, seed=19)
    cpu = [p.clone().requires_grad_() for p in init]
    gpu = [p.cuda().requires_grad_() for p in init]
    oc, og = MAKERS[name](cpu), MAKERS[name](gpu)
    gen = torch.Generator().manual_seed(20)
    # GPU fp32 math contracts to FMA and reduces in another order; LAMB's roundings cluster (see above)
    fp32_rtol, ties = (1e-4, 0.05) if name == "lamb" else (1e-5, 1e-3)
    for i in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) * 4 for p in init]
        _set_grads(cpu, grads)
        _set_grads(gpu, [g.cuda() for g in grads])
        skip = torch.tensor(float(i == 2))
        oc.step(grad_scale=torch.tensor(4.0), found_inf=skip)
        og.step(grad_scale=torch.tensor(4.0, device="cuda"), found_inf=skip.cuda())
        for x, y in zip(cpu, gpu):
            _assert_same_rounding(y.detach().cpu(), x.detach(), f"step {i} param", fp32_rtol, ties)
            for key, value in oc.state[x].items():
                _assert_same_rounding(og.state[y][key].cpu(), value, f"step {i} {key}", fp32_rtol, ties)
            with torch.no_grad():
                y.copy_(x)
                for key, value in oc.state[x].items():
                    og.state[y][key].copy_(value)


def test_compiled_entry_points_check_their_arguments():
    """_C is reachable directly too: its own checks raise clear errors (apex checks none)."""
    if ops.backend("cpu") != "cpu-ext":
        pytest.skip("compiled extension not built")
    ext = ops._ext._EXT
    a = _adam_lists()
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, None, None)
    with pytest.raises(ValueError, match="grads has 2 tensors but params has 3"):
        ext.multi_tensor_adam(a["params"], a["grads"][:2], a["exp_avgs"], a["exp_avg_sqs"], [], a["steps"], [], *hyper)
    bad = list(a["exp_avgs"])
    bad[1] = bad[1].half()
    with pytest.raises(TypeError, match="exp_avgs\\[1\\]"):
        ext.multi_tensor_adam(a["params"], a["grads"], bad, a["exp_avg_sqs"], [], a["steps"], [], *hyper)
    bad = list(a["grads"])
    bad[2] = torch.zeros(4)
    with pytest.raises(ValueError, match="grads\\[2\\] shape"):
        ext.multi_tensor_sgd(a["params"], bad, [], [], 0.1, 0.0, 0.0, 0.0, False, False, None, None)
    with pytest.raises(TypeError, match="found_inf"):
        ext.multi_tensor_adadelta(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["steps"], [],
                                  1.0, 0.9, 1e-6, 0.0, None, torch.zeros(2))
    with pytest.raises(TypeError, match="model_copies"):
        ext.multi_tensor_lamb(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["steps"],
                              [torch.zeros(10) for _ in range(3)], 1e-3, 0.9, 0.999, 1e-6, 0.01, True, True, True,
                              torch.ones(()), 1.0, False, None, None)
