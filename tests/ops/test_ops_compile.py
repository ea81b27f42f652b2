"""The compiled kernels as torch.library operators: torch.compile(fullgraph=True) traces through them.

A training step (forward, backward, FusedAdam step) compiles without graph breaks and matches the
eager step; so does the fused weight-gradient GEMM inside a custom backward (the TP layers' own compiled
step: tests/parallel/test_tp_compile.py). The
operators' schemas and fake kernels pass torch.library.opcheck.
"""
import pytest
import torch
from torch import nn

from lightning_amp import ops
from lightning_amp.optimizers import FusedAdam, FusedSGD

EXT = ops._ext_for("cpu")
needs_ext = pytest.mark.skipif(EXT is None, reason=f"compiled extension not loaded: {ops.extension_error()}")
needs_backward_tracing = pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                                            reason="this torch's dynamo does not trace Tensor.backward()")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model, opt, step, batches):
    losses = []
    for x, y in batches:
        losses.append(step(model, opt, x, y))
        opt.zero_grad()  # torch's zero_grad is not traced by dynamo: outside the compiled step
    return losses


def _step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def _batches(n=3):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(n)]


def _compiled_matches_eager(opt_cls, backend, path, monkeypatch, **kwargs):
    if path == "ext" and EXT is None:
        pytest.skip("compiled extension not loaded")
    if path == "fallback":
        monkeypatch.setattr(ops._ext, "_EXT", None)
    torch._dynamo.reset()
    ref, ours = _model(), _model()
    ref_opt, opt = opt_cls(ref.parameters(), **kwargs), opt_cls(ours.parameters(), **kwargs)
    batches = _batches()
    # the first step creates the optimizer state (eagerly in both runs), then the steps are compiled
    _train(ref, ref_opt, _step, batches[:1])
    _train(ours, opt, _step, batches[:1])
    expected = _train(ref, ref_opt, _step, batches[1:])
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(_step, fullgraph=True, backend=backend)
        got = _train(ours, opt, compiled, batches[1:])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-6)


@needs_ext
@needs_backward_tracing
@pytest.mark.parametrize("path", ["ext", "fallback"])  # fallback: eager torch._fused_*_, compiled the loop
@pytest.mark.parametrize("opt_cls,kwargs", [(FusedAdam, dict(lr=1e-2, weight_decay=0.1)),
                                            (FusedSGD, dict(lr=1e-2, momentum=0.9))], ids=["adam", "sgd"])
def test_training_step_compiles_fullgraph(opt_cls, kwargs, path, monkeypatch):
    """aot_eager: dynamo + AOTAutograd (functionalization of the in-place ops) without inductor's codegen."""
    _compiled_matches_eager(opt_cls, "aot_eager", path, monkeypatch, **kwargs)


@needs_ext
@needs_backward_tracing
def test_training_step_compiles_fullgraph_inductor(monkeypatch):
    """The same step through inductor's CPU code generation (a C++ compiler; 7 s on 2 idle cores)."""
    _compiled_matches_eager(FusedAdam, "inductor", "ext", monkeypatch, lr=1e-2, weight_decay=0.1)


def _opcheck_cases():
    r = lambda *s, dtype=torch.float32: torch.randn(*s, dtype=dtype)  # noqa: E731
    z = lambda: torch.zeros(())  # noqa: E731
    pair = lambda: [r(8), r(3)]  # noqa: E731
    lamp = ops._library.lamp
    cases = {
        "wgrad_gemm_accum_fp32": (lamp.wgrad_gemm_accum_fp32, (r(4, 6, dtype=torch.bfloat16),
                                                               r(4, 5, dtype=torch.bfloat16), r(5, 6))),
        "wgrad_gemm_accum_fp16": (lamp.wgrad_gemm_accum_fp16, (r(4, 6), r(4, 5), r(5, 6, dtype=torch.bfloat16))),
        "multi_tensor_scale": (lamp.multi_tensor_scale, (pair(), pair(), 0.5, z())),
        "multi_tensor_check_finite": (lamp.multi_tensor_check_finite, (pair(), z())),
        "multi_tensor_l2norm": (lamp.multi_tensor_l2norm, (pair(), True)),
        "multi_tensor_adam": (lamp.multi_tensor_adam, (pair(), pair(), pair(), [t.abs() for t in pair()], [],
                                                       [z(), z()], [], 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True,
                                                       None, None)),
        "multi_tensor_sgd": (lamp.multi_tensor_sgd, (pair(), pair(), pair(), [], 0.1, 0.9, 0.0, 0.0, False, True,
                                                     None, None)),
        "multi_tensor_adadelta": (lamp.multi_tensor_adadelta, (pair(), pair(), [t.abs() for t in pair()],
                                                               [t.abs() for t in pair()], [z(), z()], [], 1.0, 0.9,
                                                               1e-6, 0.0, None, None)),
        "multi_tensor_lamb": (lamp.multi_tensor_lamb, (pair(), pair(), pair(), [t.abs() for t in pair()],
                                                       [z(), z()], [], 1e-3, 0.9, 0.999, 1e-6, 0.01, True, True,
                                                       True, z() + 1.0, 1.0, False, None, None)),
        "multi_tensor_lamb_moments": (lamp.multi_tensor_lamb_moments, (pair(), pair(), pair(),
                                                                       [t.abs() for t in pair()], [z(), z()], 0.9,
                                                                       0.999, 1e-6, 0.01, True, True, True, z() + 1.0,
                                                                       1.0, None, None)),
        "multi_tensor_lamb_apply": (lamp.multi_tensor_lamb_apply, (pair(), pair(), [t.abs() for t in pair()],
                                                                   [z() + 1, z() + 1], [], 1e-3, 0.9, 0.999, 1e-6,
                                                                   0.01, True, True, False,
                                                                   torch.rand(2, 2, dtype=torch.float64), None)),
    }
    # given a grad_scale the optimizer steps also write the grads (unscaled): the schema must say so
    for name in ("multi_tensor_adam", "multi_tensor_sgd", "multi_tensor_adadelta", "multi_tensor_lamb",
                 "multi_tensor_lamb_moments"):
        op, args = cases[name]
        cases[f"{name}-grad_scale"] = (op, args[:-2] + (z() + 4.0, None))
    return cases


@needs_ext
@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_operators_pass_opcheck(name):
    """Schema (declared writes), fake kernel and AOT dispatch of each operator, checked by torch."""
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@needs_ext
def test_meta_tensors_are_refused_by_the_cpp_checks():
    """Plain meta tensors dispatch to the fake kernels, which leave the refusal to the C++ checks."""
    meta = [torch.empty(3, device="meta")]
    with pytest.raises(ValueError, match=r"is on meta, but this build has kernels for"):
        ops._library.lamp.multi_tensor_l2norm(meta, True)
    with pytest.raises(ValueError, match=r"is on meta, but this build has kernels for"):
        ops._library.lamp.multi_tensor_sgd(meta, meta, [], [], 0.1, 0.0, 0.0, 0.0, False, True, None, None)


class _FusedWgradLinear(torch.autograd.Function):
    """y = x @ W^T whose weight gradient is accumulated into ``main_grad`` by the fused GEMM, ``main_grad`` a
    tensor input of ``apply`` (as the TP layers' backward under a trace; tests/parallel/test_tp_compile.py)."""

    @staticmethod
    def forward(ctx, x, weight, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad = main_grad
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        ops.wgrad_gemm_accum_fp32(x, grad_output.contiguous(), ctx.main_grad)
        return grad_output @ weight, None, None


@needs_ext
@needs_backward_tracing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_in_backward_compiles_fullgraph(dtype):
    """The in-place weight-gradient GEMM inside a compiled backward accumulates as in eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 8, generator=gen).to(dtype)
    weight = torch.randn(6, 8, generator=gen).to(dtype)

    def step(x, weight, main_grad):
        out = _FusedWgradLinear.apply(x, weight, main_grad)
        out.float().pow(2).sum().backward()
        return out.detach()

    def run(fn, main_grad):
        leaves = [x.detach().clone().requires_grad_() for _ in range(2)]
        outs = [fn(leaf, weight, main_grad) for leaf in leaves]
        return outs, [leaf.grad for leaf in leaves]

    ref_main, main = torch.zeros(6, 8), torch.zeros(6, 8)
    expected = run(step, ref_main)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = run(torch.compile(step, fullgraph=True, backend="aot_eager"), main)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(main, ref_main, rtol=1e-5, atol=1e-5)
    assert main.abs().max() > 0


@needs_ext
def test_public_ops_under_a_fake_tensor_mode_reach_the_fake_kernels():
    """Eager calls go straight to the C++ entry points; under a dispatch mode (here fake tensors, as in
    export or a trace) the public ops go through the operators, whose fake kernels give the metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensors = [torch.empty(5), torch.empty(3, 2)]
        total, each = ops.multi_tensor_l2norm(tensors, per_tensor=True)
        found_inf, flags = ops.multi_tensor_scale(tensors, [torch.empty_like(t) for t in tensors], 0.5, True)
        params = [torch.empty(4)]
        ops.multi_tensor_adam(params, [torch.empty(4)], [torch.empty(4)], [torch.empty(4)], [torch.zeros(())],
                              lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert total.shape == () and each.shape == (2,) and flags.shape == (2,) and flags.dtype == torch.float32
