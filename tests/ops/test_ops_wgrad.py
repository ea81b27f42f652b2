"""ops.wgrad_gemm_accum_fp32 / _fp16 against fp64 references, compiled path vs fallback."""
import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from lightning_amp import ops
from support.bounds import two_orders_apart

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
    # the same sums of 111 products (exact for 16-bit operands) and main's value, in the order of this CPU's GEMM path
    # vs the fallback's matmul: within twice the rounding bound of each element's sum; one token's products lie
    # ~500x above it (a dropped K-chunk, or products rounded to 16 bits, shows)
    x2, g2 = x.reshape(-1, x.shape[-1]).double(), g.reshape(-1, g.shape[-1]).double()
    bound = two_orders_apart(main.double().abs() + g2.abs().t() @ x2.abs(), x2.shape[0] + 1)
    assert ((a.double() - b.double()).abs() <= bound).all(), ((a.double() - b.double()).abs() / bound).max()
    assert (b.double().abs() > 100 * bound).any()


CPU_PATHS = ("onednn", "mkl", "aten")


def _unusable(dtype):
    """{path: why it cannot serve dtype here} for the paths that cannot."""
    return {p: why for p, why in EXT._wgrad_cpu_gemm_paths(str(dtype)[6:]) if why}


@contextlib.contextmanager
def _policy(policy, k_chunk=0):
    EXT._set_wgrad_cpu_gemm_policy(policy)
    EXT._set_wgrad_k_chunk(k_chunk)
    try:
        yield
    finally:
        EXT._set_wgrad_k_chunk(0)
        EXT._set_wgrad_cpu_gemm_policy("auto")


def _skip_unusable(path, dtype):
    if dtype != torch.float32 and path in _unusable(dtype):
        pytest.skip(f"CPU GEMM path {path} cannot serve {dtype} here: {_unusable(dtype)[path]}")


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("policy", CPU_PATHS)
def test_k_chunking_path(dtype, policy):
    """Splitting the token dimension (done for > 2^31-element operands, and in steps on the oneDNN
    path) gives the same sum.

    The test hook lowers the rows-per-call cap so 101 tokens run as 15 calls of 7 rows (odd: the
    oneDNN path pads each step with a zero row); each CPU GEMM path for 16-bit operands is forced.
    """
    _skip_unusable(policy, dtype)
    x, g, main = _operands((101,), 19, 23, dtype, 50)
    ref = _reference(x, g, main)
    assert EXT._wgrad_k_chunk() == 0
    with _policy(policy, k_chunk=7):
        if dtype != torch.float32:
            assert EXT._wgrad_cpu_gemm_backend(str(dtype)[6:]) == policy
        EXT.wgrad_gemm_accum_fp32(x, g, main)
        half = main.to(torch.bfloat16)
        before = half.clone()
        EXT.wgrad_gemm_accum_fp16(x, g, half)
    assert _rel_err(main, ref) < 1e-5
    _assert_rounded_once(half, x, g, before)


# Shapes around the oneDNN path's blocks (32 rows of main_grad, 64 columns, 1024-4096 tokens per
# step) and its 512 KiB panels of 64-column blocks, plus the tiny and the one-token cases.
PATH_SHAPES = [((1,), 1, 1), ((2,), 3, 5), ((1025,), 65, 33), ((3, 7), 130, 31), ((2049,), 64, 32),
               ((300,), 700, 97), ((17,), 1000, 2), ((1100,), 300, 40), ((4101,), 20, 30)]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("policy", CPU_PATHS)
def test_each_cpu_path_matches_fp64(dtype, policy):
    """Every usable 16-bit path sums exact products in fp32 into main_grad (fresh inputs)."""
    _skip_unusable(policy, dtype)
    seed = torch.seed()
    with _policy(policy):
        for i, (lead, n_in, n_out) in enumerate(PATH_SHAPES):
            x, g, main = _operands(lead, n_in, n_out, dtype, seed + i)
            ref = _reference(x, g, main)
            EXT.wgrad_gemm_accum_fp32(x, g, main)
            assert _rel_err(main, ref) < 1e-5, (policy, lead, n_in, n_out, seed)


@needs_ext
@pytest.mark.parametrize("policy", CPU_PATHS)
def test_each_cpu_path_half_main_grad_in_tiles(policy):
    """A 16-bit main_grad above the fp32 tile size (4M elements) runs as two row tiles: each path then
    reads grad_output as a column slice of a wider matrix; every element is still rounded once."""
    _skip_unusable(policy, torch.bfloat16)
    seed = torch.seed()
    x, g, main = _operands((5,), 1030, 4100, torch.bfloat16, seed)
    half = main.bfloat16()
    before = half.clone()
    with _policy(policy):
        EXT.wgrad_gemm_accum_fp16(x, g, half)
    _assert_rounded_once(half, x, g, before, f"{policy}, seed {seed}")


def _auto_rule(paths):
    """The path "auto" takes, from ``_wgrad_cpu_gemm_paths``' answer ``[(path, why unusable)]``: MKL (else
    oneDNN) where oneDNN's micro-kernel takes the dtype on this CPU (usable, or refused only because
    ``torch.backends.mkldnn`` is off), the fp32 upcast elsewhere."""
    why = dict(paths)
    if not why["onednn"] or why["onednn"].startswith("oneDNN is disabled"):
        return next((p for p in ("mkl", "onednn") if not why[p]), "aten")
    return "aten"


@needs_ext
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_auto_without_a_machine_choice_is_a_rule_of_the_cpu_and_fastest_takes_the_fastest_measured_path(dtype):
    """"auto" (the default) takes the machine's measured choice (tests/ops/test_ops_wgrad_choice.py), and
    without one a rule of the CPU, so every process on the machine sums in the same order (a run and its
    resumed copy, every rank). "fastest" times every usable path once per process and keeps the fastest:
    the measurement lists each usable path once, fastest first, and the backend is its first."""
    ops.wgrad_cpu_gemm(getattr(torch, dtype))  # this process's machine choice, decided
    machine = EXT._wgrad_cpu_gemm_choice(dtype)
    EXT._set_wgrad_cpu_gemm_choice(dtype, "")
    try:
        _rule_and_fastest(dtype)
    finally:
        EXT._set_wgrad_cpu_gemm_choice(dtype, machine)


def _rule_and_fastest(dtype):
    paths = EXT._wgrad_cpu_gemm_paths(dtype)
    assert EXT._wgrad_cpu_gemm_backend(dtype) == _auto_rule(paths)
    usable = [p for p, why in paths if not why]
    assert "aten" in usable
    with _policy("fastest"):
        ranked = EXT._wgrad_cpu_gemm_calibration(dtype)
        assert sorted(p for p, _ in ranked) == sorted(usable)
        seconds = [s for _, s in ranked]
        assert seconds == sorted(seconds) and all(0 < s < float("inf") for s in seconds)
        assert EXT._wgrad_cpu_gemm_backend(dtype) == ranked[0][0]
        assert EXT._wgrad_cpu_gemm_calibration(dtype) == ranked  # measured once, not per call
    assert EXT._wgrad_cpu_gemm_backend(dtype) == _auto_rule(paths)  # the measurement does not move "auto"


@needs_ext
@pytest.mark.parametrize("policy", ["auto", "fastest"])
def test_onednn_switched_off_is_not_used(policy):
    """torch.backends.mkldnn.enabled = False makes the oneDNN path unusable at once: "auto" and "fastest"
    take another path, a forced "onednn" raises naming why. Where this CPU's oneDNN micro-kernel refuses
    bf16 anyway (no AMX), that refusal is the reason named (the CPU's answer comes first)."""
    refused_by_cpu = _unusable(torch.bfloat16).get("onednn")
    with _policy(policy):
        EXT._wgrad_cpu_gemm_backend("bfloat16")  # "fastest": measured while oneDNN is on (once per process)
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            reason = _unusable(torch.bfloat16)["onednn"]
            assert reason == refused_by_cpu if refused_by_cpu else reason.startswith("oneDNN is disabled")
            assert EXT._wgrad_cpu_gemm_backend("bfloat16") != "onednn"
            x, g, main = _operands((9,), 12, 10, torch.bfloat16, 70)
            ref = _reference(x, g, main)
            EXT.wgrad_gemm_accum_fp32(x, g, main)
            assert _rel_err(main, ref) < 1e-5
        finally:
            torch.backends.mkldnn.enabled = enabled
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        with _policy("onednn"), pytest.raises(RuntimeError, match="path 'onednn'.*cannot serve.*"
                                                                   + re.escape(reason[:40])):
            EXT.wgrad_gemm_accum_fp32(x, g, main)
    finally:
        torch.backends.mkldnn.enabled = enabled


@needs_ext
def test_cpu_gemm_hooks():
    assert [p for p, _ in EXT._wgrad_cpu_gemm_paths("bfloat16")] == list(CPU_PATHS)
    if torch.backends.mkl.is_available():
        assert "mkl" not in _unusable(torch.bfloat16) and "mkl" not in _unusable(torch.float16)
    assert EXT._wgrad_cpu_gemm_backend("bfloat16") in CPU_PATHS
    assert EXT._wgrad_cpu_gemm_backend("float32") == "aten"
    assert set(_unusable(torch.float32)) == {"onednn", "mkl"}
    with pytest.raises(ValueError, match="rows must be >= 0"):
        EXT._set_wgrad_k_chunk(-1)
    with pytest.raises(ValueError, match="'auto', 'fastest', 'onednn', 'mkl' or 'aten'"):
        EXT._set_wgrad_cpu_gemm_policy("fast")
    with pytest.raises(ValueError, match="float32 operands are not measured"):
        EXT._wgrad_cpu_gemm_calibration("float32")


# What each CPU kind lets the libraries use, emulated by capping their ISA (oneDNN reads
# ONEDNN_MAX_CPU_ISA, MKL reads MKL_ENABLE_INSTRUCTIONS at load; torch's bf16 matmul follows oneDNN's).
# kind -> (environment, the CPU flags the kind needs from the host, paths unusable for bf16, for fp16)
CPU_KINDS = {
    "avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, {"avx2"}, {"onednn"}, {"onednn"}),
    "avx512_bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"},
                    {"avx512_bf16"}, set(), {"onednn"}),
    "amx": ({}, {"amx_bf16", "amx_tile"}, set(), None),  # fp16 on oneDNN needs AVX512-FP16: host-dependent
}

_KIND_SCRIPT = """
import json, torch
from lightning_amp import ops
ext = ops._ext_for("cpu")
out = {}
for dt in (torch.bfloat16, torch.float16):
    name = str(dt)[6:]
    usable = [p for p, why in ext._wgrad_cpu_gemm_paths(name) if not why]
    errs = {}
    for policy in usable + ["auto", "fastest"]:
        ext._set_wgrad_cpu_gemm_policy(policy)
        gen = torch.Generator().manual_seed(SEED)
        x = torch.randn(333, 70, generator=gen).to(dt)
        g = torch.randn(333, 129, generator=gen).to(dt)
        main = torch.randn(129, 70, generator=gen)
        ref = main.double() + g.double().t() @ x.double()
        ext.wgrad_gemm_accum_fp32(x, g, main)
        errs[policy] = ((main.double() - ref).norm() / ref.norm()).item()
    ext._set_wgrad_cpu_gemm_policy("fastest")
    fastest = ext._wgrad_cpu_gemm_backend(name)
    ext._set_wgrad_cpu_gemm_policy("auto")
    out[name] = dict(unusable=sorted(p for p, why in ext._wgrad_cpu_gemm_paths(name) if why), errs=errs,
                     paths=ext._wgrad_cpu_gemm_paths(name), ranked=[p for p, _ in ext._wgrad_cpu_gemm_calibration(name)],
                     backend=ext._wgrad_cpu_gemm_backend(name), fastest=fastest)
print("RESULT " + json.dumps(out))
"""


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


@pytest.mark.slow
@needs_ext
@pytest.mark.parametrize("kind", list(CPU_KINDS))
def test_cpu_kind_paths_and_choice(kind):
    """Each CPU kind we meet (AMX; AVX512-BF16 without AMX; AVX2 only), emulated on a bigger CPU by
    capping oneDNN's and MKL's ISA in a fresh process: the paths that cannot run there are refused
    (not used), every usable path, "auto" and "fastest" match fp64, "auto" takes the CPU's rule and "fastest"
    its measured fastest."""
    env_caps, needs, bf16_unusable, f16_unusable = CPU_KINDS[kind]
    missing = needs - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}: it cannot stand in for a {kind} CPU")
    seed = torch.seed() % 2**31
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                                           "LIGHTNING_AMP_WGRAD_CPU_GEMM")}
    env.update(env_caps)
    proc = subprocess.run([sys.executable, "-c", _KIND_SCRIPT.replace("SEED", str(seed))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for name, unusable in (("bfloat16", bf16_unusable), ("float16", f16_unusable)):
        r = result[name]
        if unusable is not None:
            assert set(r["unusable"]) == unusable, (kind, name, r)
        assert set(r["errs"]) == set(r["ranked"]) | {"auto", "fastest"}, r
        assert all(err < 1e-5 for err in r["errs"].values()), (kind, name, seed, r)
        assert r["backend"] == _auto_rule(r["paths"]), r
        assert r["fastest"] == r["ranked"][0], r


@pytest.mark.slow
@needs_ext
def test_policy_from_environment():
    """LIGHTNING_AMP_WGRAD_CPU_GEMM pins the path at import; a bad value is a ValueError naming it."""
    env = dict(os.environ, LIGHTNING_AMP_WGRAD_CPU_GEMM="aten")
    code = "from lightning_amp import ops; print(ops._ext_for('cpu')._wgrad_cpu_gemm_backend('bfloat16'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "aten", proc.stderr[-2000:]
    env["LIGHTNING_AMP_WGRAD_CPU_GEMM"] = "fast"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ValueError: LIGHTNING_AMP_WGRAD_CPU_GEMM='fast'" in proc.stderr and "'fastest'" in proc.stderr


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
