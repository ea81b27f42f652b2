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


@pytest.mark.parametrize("main_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_half_main_grad_rounds_once_from_fp32(dtype, main_dtype):
    impls = [("fallback", ops._wgrad_fallback)] + ([("ext", EXT.wgrad_gemm_accum_fp16)] if EXT is not None else [])
    for seed, (name, fn) in enumerate(impls):
        x, g, main = _operands((5, 7), 33, 70, dtype, 20 + seed)
        main = main.to(main_dtype)
        ref = _reference(x, g, main)
        fn(x, g, main)
        assert main.dtype == main_dtype
        # One rounding of the fp32-accurate sum: within one half-precision ulp of the fp64 value.
        eps = torch.finfo(main_dtype).eps
        err = (main.double() - ref).abs()
        assert bool((err <= eps * ref.abs() + 1e-6).all()), (name, err.max().item())


def test_public_fp16_op_accumulates():
    x, g, main = _operands((6,), 40, 24, torch.bfloat16, 30)
    main = main.bfloat16()
    ref = _reference(x, g, main)
    ops.wgrad_gemm_accum_fp16(x, g, main)
    err = (main.double() - ref).abs()
    assert bool((err <= torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-6).all())


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
        half_ref = _reference(x, g, half)
        EXT.wgrad_gemm_accum_fp16(x, g, half)
    finally:
        EXT._set_wgrad_k_chunk(0)
        EXT._set_wgrad_cpu_gemm_policy("auto")
    assert _rel_err(main, ref) < 1e-5
    eps = torch.finfo(torch.bfloat16).eps
    assert bool(((half.double() - half_ref).abs() <= eps * half_ref.abs() + 1e-6).all())


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
    with pytest.raises(ValueError, match="device"):
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
        if dtype != torch.float32:
            half = main.to(dtype)
            half_ref = _reference(x.cpu(), g.cpu(), half.cpu())
            ops.wgrad_gemm_accum_fp16(x, g, half)
            eps = torch.finfo(dtype).eps
            assert bool(((half.cpu().double() - half_ref).abs() <= eps * half_ref.abs() + 1e-5).all())
