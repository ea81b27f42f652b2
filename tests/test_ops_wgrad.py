"""ops.wgrad_gemm_accum_fp32 / _fp16 against fp64 references, compiled path vs fallback."""
import pytest
import torch

from lightning_amp import ops

EXT = ops._ext_for("cpu")
needs_ext = pytest.mark.skipif(EXT is None, reason=f"compiled extension not loaded: {ops.extension_error()}")

# (leading dims of input/grad_output, in features, out features): odd sizes, 1, empty, 3-D.
SHAPES = [((1,), 1, 1), ((7,), 33, 1000), ((3, 5), 7, 33), ((2, 3, 11), 1000, 7), ((0,), 5, 3)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _operands(lead, n_in, n_out, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n_in, generator=gen).to(dtype)
    g = torch.randn(*lead, n_out, generator=gen).to(dtype)
    main = torch.randn(n_out, n_in, generator=gen)
    return x, g, main


def _reference(x, g, main):
    """fp64 of main + g^T @ x on the (already rounded) operand values."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    g2 = g.reshape(-1, g.shape[-1]).double()
    return main.double() + g2.t() @ x2


def _rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _impls():
    impls = [("fallback", ops._wgrad_fallback)]
    if EXT is not None:
        impls.append(("ext", EXT.wgrad_gemm_accum_fp32))
    return impls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_main_grad_matches_fp64(shape, dtype):
    lead, n_in, n_out = shape
    for seed, (name, fn) in enumerate(_impls()):
        x, g, main = _operands(lead, n_in, n_out, dtype, seed)
        ref = _reference(x, g, main)
        fn(x, g, main)
        assert main.dtype == torch.float32
        assert _rel_err(main, ref) < 1e-5, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_public_op_accumulates_over_micro_batches(dtype):
    x1, g1, main = _operands((4, 9), 65, 17, dtype, 10)
    x2, g2, _ = _operands((3, 9), 65, 17, dtype, 11)
    ref = _reference(x2, g2, _reference(x1, g1, main))
    ops.wgrad_gemm_accum_fp32(x1, g1, main)
    ops.wgrad_gemm_accum_fp32(x2, g2, main)
    assert _rel_err(main, ref) < 1e-5


def test_large_bf16_transformer_shape():
    x, g, main = _operands((2048,), 1024, 512, torch.bfloat16, 3)
    ref = _reference(x, g, main)
    ops.wgrad_gemm_accum_fp32(x, g, main)
    assert _rel_err(main, ref) < 1e-5


def test_non_contiguous_operands_are_accepted():
    x, g, main = _operands((20,), 30, 12, torch.bfloat16, 4)
    xt = x.t().contiguous().t()  # same values, column-major storage
    ref = _reference(x, g, main)
    ops.wgrad_gemm_accum_fp32(xt, g[:, :], main)
    assert _rel_err(main, ref) < 1e-5


def _ulp(ref, dtype):
    """The spacing of dtype's values around each |ref| (fp64), subnormal spacing at the bottom."""
    _, exp = torch.frexp(ref.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.full_like(ref, torch.finfo(dtype).eps), exp - 1)


def _assert_rounded_once(half, x, g, main_before, note="", fp32_sum=None):
    """half (16-bit) is the rounding of the fp32-accumulated main + g^T @ x: within 0.5 ulp of the
    fp64 value (ties aside), plus the error of the fp32 accumulation. That error is bounded by
    K * 2^-24 * sum of |terms| (for small K four orders of magnitude below a 16-bit ulp); for large
    K, where that worst case exceeds an ulp, it is measured instead: ``fp32_sum`` is the same sum
    accumulated by the fp32 op of the same device. Rounding twice (a 16-bit product, or 16-bit
    partial sums written into a 16-bit C by split-K) exceeds the bound."""
    ref = _reference(x, g, main_before)
    if fp32_sum is None:
        x2 = x.reshape(-1, x.shape[-1]).double().abs()
        g2 = g.reshape(-1, g.shape[-1]).double().abs()
        accumulation = (x2.shape[0] + 1) * 2.0**-24 * (main_before.double().abs() + g2.t() @ x2)
    else:
        accumulation = (fp32_sum.double() - ref).abs()
    bound = 0.5 * torch.maximum(_ulp(ref, half.dtype), _ulp(half.double(), half.dtype)) + accumulation
    err = (half.double() - ref).abs()
    assert bool((err <= bound).all()), (note, (err / bound).max().item())


@pytest.mark.parametrize("main_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_half_main_grad_rounds_once_from_fp32(dtype, main_dtype):
    impls = [("fallback", ops._wgrad_fallback)] + ([("ext", EXT.wgrad_gemm_accum_fp16)] if EXT is not None else [])
    for name, fn in impls:
        seed = torch.seed()  # fresh inputs every run; the bound holds for any
        x, g, main = _operands((5, 7), 33, 70, dtype, seed)
        main = main.to(main_dtype)
        before = main.clone()
        fn(x, g, main)
        assert main.dtype == main_dtype
        _assert_rounded_once(main, x, g, before, f"{name}, seed {seed}")


def test_public_fp16_op_accumulates():
    x, g, main = _operands((6,), 40, 24, torch.bfloat16, 30)
    main = main.bfloat16()
    before = main.clone()
    ops.wgrad_gemm_accum_fp16(x, g, main)
    _assert_rounded_once(main, x, g, before)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ext_matches_fallback(dtype):
    x, g, main = _operands((3, 37), 129, 65, dtype, 40)
    a, b = main.clone(), main.clone()
    EXT.wgrad_gemm_accum_fp32(x, g, a)
    ops._wgrad_fallback(x, g, b)
    assert _rel_err(a, b.double()) < 1e-6


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", ["mkl", "aten"])
def test_k_chunking_path(dtype, policy):
    """Splitting the token dimension (done for > 2^31-element operands) gives the same sum.

    The test hook lowers the rows-per-BLAS-call cap so 101 tokens run as 15 calls; both CPU
    GEMM paths for 16-bit operands (MKL's 16-bit GEMM and the upcast-block path) are forced.
    """
    if policy == "mkl" and dtype != torch.float32 and not EXT._wgrad_cpu_has_mkl_gemm(str(dtype)[6:]):
        pytest.skip("this torch exports no MKL 16-bit GEMM")
    x, g, main = _operands((101,), 19, 23, dtype, 50)
    ref = _reference(x, g, main)
    assert EXT._wgrad_k_chunk() == 0
    EXT._set_wgrad_k_chunk(7)
    EXT._set_wgrad_cpu_gemm_policy(policy)
    try:
        if dtype != torch.float32:
            assert EXT._wgrad_cpu_gemm_backend(str(dtype)[6:]) == policy
        EXT.wgrad_gemm_accum_fp32(x, g, main)
        half = main.to(torch.bfloat16)
        before = half.clone()
        EXT.wgrad_gemm_accum_fp16(x, g, half)
    finally:
        EXT._set_wgrad_k_chunk(0)
        EXT._set_wgrad_cpu_gemm_policy("auto")
    assert _rel_err(main, ref) < 1e-5
    _assert_rounded_once(half, x, g, before)


@needs_ext
def test_cpu_gemm_hooks():
    if torch.backends.mkl.is_available():
        assert EXT._wgrad_cpu_has_mkl_gemm("bfloat16") and EXT._wgrad_cpu_has_mkl_gemm("float16")
    assert EXT._wgrad_cpu_gemm_backend("bfloat16") in ("mkl", "aten")
    assert EXT._wgrad_cpu_gemm_backend("float32") == "aten"
    with pytest.raises(ValueError, match="rows must be >= 0"):
        EXT._set_wgrad_k_chunk(-1)
    with pytest.raises(ValueError, match="'auto', 'mkl' or 'aten'"):
        EXT._set_wgrad_cpu_gemm_policy("fast")


# ---------------------------------------------------------------- argument errors


def _entry_points():
    fns = [ops.wgrad_gemm_accum_fp32]
    if EXT is not None:
        fns.append(EXT.wgrad_gemm_accum_fp32)
    return fns


@pytest.mark.parametrize("fn", _entry_points(), ids=lambda f: f.__module__ or "ext")
def test_errors(fn):
    x, g, main = _operands((4,), 6, 5, torch.bfloat16, 60)
    with pytest.raises(TypeError, match="main_grad must be"):
        fn(x, g, main.half())
    with pytest.raises(TypeError, match="float32.*float16.*bfloat16"):
        fn(x.double(), g.double(), main)
    with pytest.raises(TypeError, match="share a dtype"):
        fn(x, g.half(), main)
    with pytest.raises(ValueError, match="main_grad shape"):
        fn(x, g, main.t().contiguous())
    with pytest.raises(ValueError, match="leading dims"):
        fn(x, g[:3], main)
    with pytest.raises(ValueError, match="2-D"):
        fn(x, g, main.reshape(-1))
    with pytest.raises(ValueError, match="contiguous"):
        fn(x, g, torch.randn(6, 5).t())
    with pytest.raises(ValueError, match="meta"):
        fn(x, g, torch.empty(5, 6, device="meta"))


def test_fp16_op_rejects_fp32_main_grad():
    x, g, main = _operands((4,), 6, 5, torch.bfloat16, 61)
    with pytest.raises(TypeError, match="main_grad must be"):
        ops.wgrad_gemm_accum_fp16(x, g, main)
    if EXT is not None:
        with pytest.raises(TypeError, match="float16 or bfloat16"):
            EXT.wgrad_gemm_accum_fp16(x, g, main)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_fp64(dtype):
    assert ops.backend("cuda") == "cuda-ext"
    for lead, n_in, n_out in SHAPES + [((4096,), 1024, 4096)]:
        x, g, main = _operands(lead, n_in, n_out, dtype, 70)
        ref = _reference(x, g, main)
        x, g, main = x.cuda(), g.cuda(), main.cuda()
        ops.wgrad_gemm_accum_fp32(x, g, main)
        # TF32 is not used: CUBLAS_COMPUTE_32F keeps full fp32 products.
        assert _rel_err(main.cpu(), ref) < 1e-5
        for half_dtype in (torch.bfloat16, torch.float16):
            half = main.to(half_dtype)
            fp32_sum = half.float()
            ops.wgrad_gemm_accum_fp32(x, g, fp32_sum)
            before = half.cpu()
            ops.wgrad_gemm_accum_fp16(x, g, half)
            _assert_rounded_once(half.cpu(), x.cpu(), g.cpu(), before, f"{half_dtype}, shape {tuple(main.shape)}",
                                 fp32_sum=fp32_sum.cpu())
