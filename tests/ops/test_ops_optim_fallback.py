"""The pure-PyTorch fallbacks of the fused optimizer ops (torch's own fused Adam/AdamW/SGD kernels
where they apply, per-tensor loops elsewhere) against the compiled kernels, on the CPU; and, with the
extension loaded, torch's kernels where the choice table (lightning_amp/ops/_choice.py) may take them
("ext-torch": forced wherever both can serve) against ours (forced), so both paths of the choice run here
whatever the table says on this machine.

Each case runs three steps on the same fresh random inputs through the extension and through
the fallback (``ops._ext._EXT`` switched off), with a loss scale to divide out, then a step with
found_inf set that must change nothing (params, state, steps and model copies; the fallback without
reading the flag on the host). fp32 params and state agree norm-wise over each list to 2 n u per step
(3 steps): each element is a chain of about n roundings of terms no larger than the list's values, in
another order or with FMA on one side only (n as tests/optimizers/test_optimizers.py's FP32_ROUNDINGS:
16, Adadelta 32); 16-bit ones to one 16-bit eps (the paths round the same fp32 update, but its last fp32
bit may differ and flip a 16-bit rounding).
"""
import pytest
import torch

from lightning_amp import ops
from lightning_amp.ops import _choice

EXT = ops._ext_for("cpu")
pytestmark = pytest.mark.skipif(EXT is None, reason=f"compiled extension not loaded: {ops.extension_error()}")

SHAPES = [(1,), (33,), (1000,), (5, 7), (4099,)]


def _lists(n_lists, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(n_lists)]


def _host_read(*args, **kwargs):
    raise AssertionError("host read of a tensor inside the fallback")


IMPLS = {"ext": (True, _choice.OURS), "ext-torch": (True, _choice.TORCH), "fallback": (False, None)}


def _run(op, state_names, kwargs, pdtype, gdtype, copies, impl, monkeypatch, seed):
    """Three steps (grad_scale 4) plus one skipped step; returns every tensor the op may write."""
    use_ext, forced = IMPLS[impl]
    params, *states = _lists(1 + len(state_names), pdtype, seed)
    states = [[s.abs() for s in lst] for lst in states]  # second moments and deltas are >= 0
    steps = [torch.zeros(()) for _ in SHAPES] if "steps" in kwargs else None
    model_copies = [p.to(torch.bfloat16) for p in params] if copies else None
    with monkeypatch.context() as m:
        m.setattr(_choice, "forced", forced)
        if not use_ext:
            m.setattr(ops._ext, "_EXT", None)
        for step in range(4):
            (grads,) = _lists(1, gdtype, seed + 100 + step)
            grads = [g * 4 for g in grads]
            found_inf = torch.tensor(2.0 if step == 3 else 0.0)  # any non-zero flag skips (torch's kernels: 1.0 only)
            args = dict(kwargs, grad_scale=torch.tensor(4.0), found_inf=found_inf, model_copies=model_copies)
            if steps is not None:
                args["steps"] = steps
            written = params + sum(states, []) + (steps or []) + (model_copies or [])
            before = [t.clone() for t in written]
            with monkeypatch.context() as no_reads:
                if impl != "ext":  # the fallback and torch's kernels honour found_inf on the device: a host read raises
                    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                        no_reads.setattr(torch.Tensor, name, _host_read)
                op(params, grads, *states, **args)
            if step == 3:
                assert all(torch.equal(a, b) for a, b in zip(before, written)), "found_inf step changed a tensor"
    return params, states, steps, model_copies


ADAM = (ops.multi_tensor_adam, ["exp_avgs", "exp_avg_sqs"], dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, steps=None))
CASES = {
    "adamw": (*ADAM[:2], dict(ADAM[2], weight_decay=0.1)),
    "adam_l2": (*ADAM[:2], dict(ADAM[2], weight_decay=0.1, adam_w_mode=False)),
    "adam_no_bias_correction": (*ADAM[:2], dict(ADAM[2], bias_correction=False)),
    "sgd_nesterov": (ops.multi_tensor_sgd, ["momentum_buffers"],
                     dict(lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True)),
    "sgd_dampening": (ops.multi_tensor_sgd, ["momentum_buffers"], dict(lr=1e-2, momentum=0.9, dampening=0.3)),
    "lamb": (ops.multi_tensor_lamb, ["exp_avgs", "exp_avg_sqs"],
             dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.01, steps=None,
                  global_grad_norm=torch.tensor(50.0), max_grad_norm=1.0)),
    "lamb_nvlamb_no_clip": (ops.multi_tensor_lamb, ["exp_avgs", "exp_avg_sqs"],
                            dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.0, steps=None,
                                 global_grad_norm=torch.tensor(0.5), max_grad_norm=1.0, use_nvlamb=True)),
    "adadelta": (ops.multi_tensor_adadelta, ["square_avgs", "acc_deltas"],
                 dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.1, steps=None)),
}
# (param dtype, grad dtype, 16-bit model copies): plain fp32; fp32 masters with bf16 grads and
# copies (torch's kernels after converting the grads); bf16 params (torch's kernel or the loop).
DTYPES = [(torch.float32, torch.float32, False), (torch.float32, torch.bfloat16, True),
          (torch.bfloat16, torch.bfloat16, False)]


@pytest.mark.parametrize("other", ["fallback", "ext-torch"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}{'-copies' if d[2] else ''}")
@pytest.mark.parametrize("case", list(CASES))
def test_fallback_matches_extension(case, dtypes, other, monkeypatch):
    op, state_names, kwargs = CASES[case]
    kwargs = dict(kwargs)
    if "momentum" in kwargs:
        kwargs["first_run"] = False
    seed = torch.seed() % 2**31
    ext = _run(op, state_names, kwargs, *dtypes, impl="ext", monkeypatch=monkeypatch, seed=seed)
    ref = _run(op, state_names, kwargs, *dtypes, impl=other, monkeypatch=monkeypatch, seed=seed)
    pdtype = dtypes[0]
    roundings = 32 if case == "adadelta" else 16
    tol = 3 * 2 * roundings * 2.0 ** -24 if pdtype == torch.float32 else torch.finfo(pdtype).eps
    for i, (a, b) in enumerate(zip([ext[0]] + ext[1], [ref[0]] + ref[1])):  # params, then each state list
        a, b = (torch.cat([t.double().flatten() for t in lst]) for lst in (a, b))
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < tol, (i, rel, f"seed {seed}")
    if ext[2] is not None:
        assert all(torch.equal(x, y) for x, y in zip(ext[2], ref[2]))
        assert all(x.item() == 3.0 for x in ext[2]), "steps advance once per applied step"
    if ext[3] is not None:  # both paths write the copies: their masters rounded to bf16
        for result in (ext, ref):
            for copy, master in zip(result[3], result[0]):
                assert torch.equal(copy, master.to(torch.bfloat16))


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}{'-copies' if d[2] else ''}")
@pytest.mark.parametrize("case", list(CASES))
def test_fallback_writes_the_callers_grads_as_the_extension(case, dtypes, monkeypatch):
    """What each path does to the caller's grads, the same on both: given a grad_scale, a clean step leaves
    each grad divided by it in its own dtype (the scale a power of two: exactly the unscaled values), a
    skipped step (found_inf set) leaves them as they were (scaled, as torch's fused Adam), and without a
    grad_scale they are only read. Covers the fallback's copies (bf16 grads of fp32 masters, converted for
    torch's kernel: the unscaled values must reach the caller's grads) and its undo of a skipped step (torch's
    kernel runs without the flag: the grads it unscaled are put back). The caller's list is not changed."""
    op, state_names, kwargs = CASES[case]
    kwargs = dict(kwargs)
    if "momentum" in kwargs:
        kwargs["first_run"] = True
    pdtype, gdtype, copies = dtypes
    seed = torch.seed() % 2**31
    results = []
    for impl in IMPLS:
        use_ext, forced = IMPLS[impl]
        params, *states = _lists(1 + len(state_names), pdtype, seed)
        states = [[s.abs() for s in lst] for lst in states]
        steps = {"steps": [torch.zeros(()) for _ in SHAPES]} if "steps" in kwargs else {}
        model_copies = [p.to(torch.bfloat16) for p in params] if copies else None
        seen = []
        with monkeypatch.context() as m:
            m.setattr(_choice, "forced", forced)
            if not use_ext:
                m.setattr(ops._ext, "_EXT", None)
            for i, (scale, found) in enumerate([(65536.0, 0.0), (65536.0, 1.0), (None, 0.0)]):
                (unscaled,) = _lists(1, gdtype, seed + 200 + i)
                grads = [g * 65536 for g in unscaled]
                scaled, given = [g.clone() for g in grads], list(grads)
                flags = dict(found_inf=torch.tensor(found), grad_scale=None if scale is None else torch.tensor(scale))
                op(params, grads, *states, **dict(kwargs, **steps), **flags, model_copies=model_copies)
                assert len(grads) == len(given) and all(a is b for a, b in zip(grads, given))
                want = unscaled if scale is not None and not found else scaled
                for j, (g, w) in enumerate(zip(grads, want)):
                    assert torch.equal(g, w), (i, j, impl, f"seed {seed}")
                seen.append([g.clone() for g in grads])
        results.append(seen)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
