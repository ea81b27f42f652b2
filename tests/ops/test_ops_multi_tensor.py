"""ops.multi_tensor_scale / multi_tensor_l2norm against fp64 references; ext vs fallback."""
import pytest
import torch

from lightning_amp import ops

EXT = ops._ext_for("cpu")
needs_ext = pytest.mark.skipif(EXT is None, reason=f"compiled extension not loaded: {ops.extension_error()}")

SHAPES = [(1,), (7,), (33,), (1000,), (3, 5, 7), (65537,)]  # odd sizes; 65537 spans two chunks
PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
]


def _randn_list(shapes, dtypes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 3).to(d) for s, d in zip(shapes, dtypes)]


def _ulp(ref, dtype):
    """The spacing of dtype's values around each |ref| (fp64), subnormal spacing at the bottom."""
    _, exp = torch.frexp(ref.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.full_like(ref, torch.finfo(dtype).eps), exp - 1)


def _check_scaled(dst, src, scale, seed=None):
    """dst = round_dst(fp32(src * fp32(scale))): the fp32 product is rounded once (0.5 ulp of fp32),
    then once into dst's dtype (0.5 ulp of dst; nothing more for an fp32 dst). Ties aside, that is
    the whole error: a kernel that rounds through a narrower type or truncates exceeds it."""
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    for d, s in zip(dst, src):
        ref = s.double() * scale32
        bound = 0.5 * _ulp(ref, d.dtype)
        if d.dtype != torch.float32:
            bound = bound + 0.5 * _ulp(ref, torch.float32)
        err = (d.double() - ref).abs()
        assert bool((err <= bound).all()), (s.dtype, d.dtype, (err / bound).max().item(), f"seed {seed}")


@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_scale_matches_fp64(pair):
    src_dtype, dst_dtype = pair
    seed = torch.seed()  # fresh inputs every run; the bound holds for any
    src = _randn_list(SHAPES, [src_dtype] * len(SHAPES), seed)
    dst = [torch.full_like(s, 12345.0, dtype=dst_dtype) for s in src]
    found_inf, flags = ops.multi_tensor_scale(src, dst, 0.3710, per_tensor=True)
    _check_scaled(dst, src, 0.3710, seed)
    assert found_inf.item() == 0.0 and found_inf.dim() == 0 and found_inf.dtype == torch.float32
    assert flags.tolist() == [0.0] * len(SHAPES)


def test_scale_mixed_dtypes_in_one_list_and_in_place():
    src = _randn_list(SHAPES, [torch.bfloat16, torch.float16, torch.float32] * 2, 2)
    orig = [s.clone() for s in src]
    found_inf, flags = ops.multi_tensor_scale(src, src, 1.0 / 1024, per_tensor=False)
    assert flags is None and found_inf.item() == 0.0
    _check_scaled(src, orig, 1.0 / 1024)


def test_scale_flags_name_the_tensors_with_inf_or_nan():
    shapes = [(5,), (1000,), (65536 * 2 + 3,), (33,), (4, 9), (17,)]
    for impl in ("ops", "fallback"):
        src = _randn_list(shapes, [torch.bfloat16, torch.float32, torch.float16, torch.float32, torch.bfloat16, torch.float32], 3)
        src[1][-1] = float("inf")  # vector tail
        src[2][65536 + 40] = float("-inf")  # second chunk of a multi-chunk tensor
        src[4][0, 0] = float("nan")
        dst = [torch.empty(s.shape) for s in src]
        if impl == "ops":
            found_inf, flags = ops.multi_tensor_scale(src, dst, 2.0, per_tensor=True)
        else:
            found_inf = torch.zeros(())
            flags = ops._scale_fallback(src, dst, 2.0, found_inf)
        assert found_inf.item() == 1.0, impl
        assert flags.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0], impl
        assert torch.isinf(dst[2][65536 + 40]) and torch.isnan(dst[4][0, 0])
        torch.testing.assert_close(dst[0], src[0].float() * 2, rtol=0, atol=0)


def test_scale_empty_list():
    found_inf, flags = ops.multi_tensor_scale([], [], 0.5, per_tensor=True)
    assert found_inf.item() == 0.0 and flags.shape == (0,)


def test_scale_large_tensor():
    src = [torch.randn(3_000_001).bfloat16(), torch.randn(3)]
    src[0][2_999_999] = float("nan")
    dst = [torch.empty(3_000_001), torch.empty(3)]
    found_inf, flags = ops.multi_tensor_scale(src, dst, 0.5, per_tensor=True)
    assert found_inf.item() == 1.0 and flags.tolist() == [1.0, 0.0]
    torch.testing.assert_close(dst[0][:-2], src[0][:-2].double().mul(0.5).float(), rtol=0, atol=0)


def test_scale_non_contiguous_uses_fallback_correctly():
    src = [torch.randn(40, 30).t()]
    dst = [torch.empty(40, 30).t()]
    ops.multi_tensor_scale(src, dst, 3.0)
    _check_scaled(dst, src, 3.0)


@needs_ext
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_scale_ext_equals_fallback_bitwise(pair):
    src = _randn_list(SHAPES, [pair[0]] * len(SHAPES), 4)
    src[2][5] = float("inf")
    a = [torch.empty(s.shape, dtype=pair[1]) for s in src]
    b = [torch.empty(s.shape, dtype=pair[1]) for s in src]
    fa, fb = torch.zeros(()), torch.zeros(())
    flags_a = EXT.multi_tensor_scale(src, a, 0.77, fa)
    flags_b = ops._scale_fallback(src, b, 0.77, fb)
    assert torch.equal(flags_a, flags_b) and torch.equal(fa, fb)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@needs_ext
def test_scale_ext_never_clears_found_inf():
    found_inf = torch.ones(())
    flags = EXT.multi_tensor_scale([torch.randn(10)], [torch.empty(10)], 1.0, found_inf)
    assert found_inf.item() == 1.0 and flags.tolist() == [0.0]


@needs_ext
def test_scale_ext_errors():
    a, b = torch.randn(8), torch.empty(8)
    flag = torch.zeros(())
    with pytest.raises(TypeError, match=r"src\[0\] must be float32, float16 or bfloat16"):
        EXT.multi_tensor_scale([a.double()], [b], 1.0, flag)
    with pytest.raises(ValueError, match=r"src\[0\] shape"):
        EXT.multi_tensor_scale([a], [torch.empty(9)], 1.0, flag)
    with pytest.raises(ValueError, match="equal length"):
        EXT.multi_tensor_scale([a, a], [b], 1.0, flag)
    with pytest.raises(ValueError, match=r"dst\[0\] must be contiguous"):
        EXT.multi_tensor_scale([torch.randn(4, 2)], [torch.empty(2, 4).t()], 1.0, flag)
    with pytest.raises(ValueError, match=r"dst\[0\] is on meta"):
        EXT.multi_tensor_scale([a], [torch.empty(8, device="meta")], 1.0, flag)
    with pytest.raises(TypeError, match="found_inf must be"):
        EXT.multi_tensor_scale([a], [b], 1.0, torch.zeros((), dtype=torch.float64))


def test_scale_ops_errors():
    with pytest.raises(ValueError, match="equal length"):
        ops.multi_tensor_scale([torch.randn(3)], [], 1.0)
    with pytest.raises(ValueError, match=r"src\[0\] shape \[3\] != dst\[0\] shape \[4\]"):
        ops.multi_tensor_scale([torch.randn(3)], [torch.empty(4)], 1.0)
    with pytest.raises(ValueError, match=r"src\[0\] shape \[3\] != dst\[0\] shape \[4\]"):  # the fallback's
        ops.multi_tensor_scale([torch.randn(3).double()], [torch.empty(4).double()], 1.0)
    with pytest.raises(TypeError, match="floating point"):
        ops.multi_tensor_scale([torch.ones(3, dtype=torch.int32)], [torch.empty(3)], 1.0)


# ---------------------------------------------------------------- L2 norm


def _norm_ref(tensors):
    each = torch.stack([t.double().pow(2).sum().sqrt() for t in tensors])
    return each.pow(2).sum().sqrt(), each


# -------------------------------------------------------------- check_finite (read only)

CHECK_IMPLS = [("fallback", ops._check_finite_fallback)] + (
    [("ext", lambda ts, f: EXT.multi_tensor_check_finite(list(ts), f))] if EXT is not None else [])


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


CUDA_DEVICE = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA_DEVICE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_check_finite_finds_each_position_and_reads_only(dtype, bad, device):
    """One non-finite value anywhere (the first element, a vector's last lane, a chunk boundary, the
    tail) sets the flag; finite lists leave it 0; the tensors are left bit for bit (read only)."""
    seed = torch.seed()
    tensors = [t.to(device) for t in _randn_list(SHAPES, [dtype] * len(SHAPES), seed)]
    for name, fn in CHECK_IMPLS:
        found = torch.zeros((), device=device)
        before = [t.clone() for t in tensors]
        fn(tensors, found)
        assert found.item() == 0.0, (name, seed)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tensors, before)), name
        for t in range(len(tensors)):
            for pos in sorted({0, 15, 16, 31, 65535, tensors[t].numel() - 1}):
                if pos >= tensors[t].numel():
                    continue
                broken = [x.clone() for x in tensors]
                broken[t].view(-1)[pos] = bad
                snapshot = [x.clone() for x in broken]
                found = torch.zeros((), device=device)
                fn(broken, found)
                assert found.item() == 1.0, (name, t, pos, seed)
                assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(broken, snapshot)), name


def test_check_finite_public_op():
    """ops.multi_tensor_check_finite: mixed dtypes, a non-contiguous tensor (fallback), empty tensors
    and lists; found_inf is never cleared; bad input names the argument."""
    tensors = _randn_list(SHAPES, [torch.bfloat16, torch.float16, torch.float32] * 2, 5)
    found = torch.zeros(())
    assert ops.multi_tensor_check_finite(tensors + [torch.empty(0)], found) is found and found.item() == 0.0
    strided = torch.randn(20, 10).t()
    strided[3, 4] = float("nan")
    ops.multi_tensor_check_finite([tensors[0], strided], found)
    assert found.item() == 1.0
    ops.multi_tensor_check_finite(tensors, found)
    assert found.item() == 1.0  # never cleared
    assert ops.multi_tensor_check_finite([], torch.zeros(())).item() == 0.0


@pytest.mark.parametrize("path", ["ext", "fallback"])
def test_check_finite_bad_input_same_errors_on_both_paths(path, monkeypatch):
    """The compiled op (checked in C++) and the fallback (checked in Python) refuse bad input alike."""
    if path == "ext" and EXT is None:
        pytest.skip("compiled extension not built")
    if path == "fallback":
        monkeypatch.setattr(ops._ext, "_EXT", None)
    tensors = _randn_list(SHAPES, [torch.bfloat16, torch.float16, torch.float32] * 2, 5)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be floating point"):
        ops.multi_tensor_check_finite([tensors[0], torch.ones(3, dtype=torch.int64)], torch.zeros(()))
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a dense"):
        ops.multi_tensor_check_finite([tensors[0].to_sparse()], torch.zeros(()))
    with pytest.raises(ValueError, match=r"tensors\[0\] is on meta"):
        ops.multi_tensor_check_finite([torch.empty(3, device="meta")], torch.zeros(()))
    with pytest.raises(ValueError, match=r"found_inf must hold one element, got shape \[2\]"):
        ops.multi_tensor_check_finite(tensors, torch.zeros(2))
    with pytest.raises(TypeError, match=r"found_inf must be Float, got Double"):
        ops.multi_tensor_check_finite(tensors, torch.zeros((), dtype=torch.float64))


@needs_ext
def test_check_finite_many_chunks():
    """Three tensors of 2^20 elements and one of 5 (49 chunks of the parallel pass): the nan in the
    very last element is found."""
    tensors = [torch.zeros(1 << 20, dtype=torch.bfloat16) for _ in range(3)] + [torch.zeros(5)]
    found = torch.zeros(())
    EXT.multi_tensor_check_finite(tensors, found)
    assert found.item() == 0.0
    tensors[-1][-1] = float("nan")
    EXT.multi_tensor_check_finite(tensors, found)
    assert found.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, None], ids=str)
def test_l2norm_matches_fp64(dtype):
    dtypes = [dtype] * len(SHAPES) if dtype else [torch.float32, torch.bfloat16, torch.float16] * 2
    tensors = _randn_list(SHAPES, dtypes, 5)
    total_ref, each_ref = _norm_ref(tensors)
    fns = [("ops", lambda ts: ops.multi_tensor_l2norm(ts, per_tensor=True)), ("fallback", ops._l2norm_fallback)]
    for name, fn in fns:
        total, each = fn(tensors)
        assert total.dtype == torch.float32 and total.dim() == 0 and each.shape == (len(tensors),)
        assert abs(total.item() - total_ref.item()) <= 1e-5 * total_ref.item(), name
        assert bool(((each.double() - each_ref).abs() <= 1e-5 * each_ref).all()), name
    assert ops.multi_tensor_l2norm(tensors)[1] is None


@needs_ext
def test_two_threads_share_the_chunks_and_equal_one_thread():
    """tests/conftest.py runs each test on one intra-op thread; here ``at::parallel_for`` hands the chunks of several
    tensors (two of them two chunks long) to 2 threads: the scale, the norms (per-chunk partials summed in chunk order)
    and FusedAdam's steps equal the one-thread run's bit for bit."""
    from lightning_amp.optimizers import FusedAdam

    def run(threads):
        torch.set_num_threads(threads)  # the fixture restores the count
        assert torch.get_num_threads() == threads
        src = _randn_list([(65537,), (33,), (70000,), (3, 5, 7)], [torch.float32, torch.bfloat16] * 2, 11)
        dst = [torch.empty_like(s) for s in src]
        found_inf, flags = ops.multi_tensor_scale(src, dst, 0.3710, per_tensor=True)
        total, each = ops.multi_tensor_l2norm(dst, per_tensor=True)
        params = [torch.nn.Parameter(s.float()) for s in src]
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for p, g in zip(params, _randn_list([p.shape for p in params], [torch.float32] * 4, 20 + step)):
                p.grad = g
            opt.step()
        return [found_inf, flags, total, each, *dst, *params]

    one, two = run(1), run(2)
    assert ops.backend("cpu") == "cpu-ext"
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_l2norm_large_tensor_and_empty_list():
    big = [torch.randn(4_000_003).bfloat16(), torch.randn(1)]
    total_ref, each_ref = _norm_ref(big)
    total, each = ops.multi_tensor_l2norm(big, per_tensor=True)
    assert abs(total.item() - total_ref.item()) <= 1e-5 * total_ref.item()
    assert bool(((each.double() - each_ref).abs() <= 1e-5 * each_ref).all())
    total, each = ops.multi_tensor_l2norm([], per_tensor=True)
    assert total.item() == 0.0 and each.shape == (0,)


def test_l2norm_propagates_inf_and_nan():
    ts = _randn_list([(100,), (70000,)], [torch.float32, torch.bfloat16], 6)
    ts[1][69999] = float("inf")
    total, each = ops.multi_tensor_l2norm(ts, per_tensor=True)
    assert torch.isinf(total) and torch.isfinite(each[0]) and torch.isinf(each[1])
    ts[0][3] = float("nan")
    total, each = ops.multi_tensor_l2norm(ts, per_tensor=True)
    assert torch.isnan(total) and torch.isnan(each[0])


@needs_ext
def test_l2norm_ext_errors():
    with pytest.raises(TypeError, match=r"tensors\[1\] must be float32"):
        EXT.multi_tensor_l2norm([torch.randn(3), torch.randn(3).double()], True)
    with pytest.raises(ValueError, match=r"tensors\[0\] must be contiguous"):
        EXT.multi_tensor_l2norm([torch.randn(3, 4).t()], True)
    with pytest.raises(ValueError, match="share one device"):
        EXT.multi_tensor_l2norm([torch.randn(3), torch.empty(3, device="meta")], True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_multi_tensor_ops():
    assert ops.backend("cuda") == "cuda-ext"
    shapes = [(1,), (7,), (33,), (1000,), (3, 5, 7), (65536 * 3 + 5,), (5_000_001,)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32] * 3
    src = [t.cuda() for t in _randn_list(shapes, dtypes, 7)]
    src[5][65536 * 2 + 1] = float("inf")
    dst = [torch.empty(s.shape, device="cuda") for s in src]
    found_inf, flags = ops.multi_tensor_scale(src, dst, 0.25, per_tensor=True)
    assert found_inf.item() == 1.0
    assert flags.cpu().tolist() == [0.0] * 5 + [1.0, 0.0]
    _check_scaled([d.cpu() for d in dst[:5]], [s.cpu() for s in src[:5]], 0.25)
    src[5][65536 * 2 + 1] = 1.0
    total_ref, each_ref = _norm_ref([s.cpu() for s in src])
    total, each = ops.multi_tensor_l2norm(src, per_tensor=True)
    assert abs(total.item() - total_ref.item()) <= 1e-5 * total_ref.item()
    assert bool(((each.cpu().double() - each_ref).abs() <= 1e-5 * each_ref).all())
