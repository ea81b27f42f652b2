"""ops.backend(), LIGHTNING_AMP_DISABLE_EXT and life without the compiled extension.

The environment variable is checked once end to end in a fresh interpreter; the other
conditions load an independent copy of the ops package in-process (cheaper than a subprocess).
"""
import glob
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from lightning_amp import ops
from support.bounds import gamma, two_orders_apart
from support.fresh_ops import fresh_ops_module

EXT = ops._ext_for("cpu")


def _run(code, tmp_path, **env):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    full_env = {**os.environ, **env}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=full_env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


# The same ops on the same seeded inputs, saved so the parent can compare implementations.
_WORKLOAD = """
    import torch
    from lightning_amp import ops
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(3, 37, 129, generator=gen).bfloat16()
    g = torch.randn(3, 37, 65, generator=gen).bfloat16()
    main = torch.randn(65, 129, generator=gen)
    ops.wgrad_gemm_accum_fp32(x, g, main)
    src = [torch.randn(n, generator=gen).bfloat16() for n in (1, 7, 70001)]
    src[2][70000] = float("nan")
    dst = [torch.empty(s.shape) for s in src]
    found_inf, flags = ops.multi_tensor_scale(src, dst, 0.125, per_tensor=True)
    # multiples of 1/8 up to 1: every square is a multiple of 2**-6 and every partial sum of 70008 of them (< 2**17)
    # fits fp32's 24 bits, so each sum of squares is exact in any order (vector width, blocking) on any CPU
    grid = [(torch.randint(-8, 9, (n,), generator=gen) / 8).to(dt)
            for n, dt in ((1, torch.bfloat16), (7, torch.bfloat16), (70000, torch.float32))]
    total, each = ops.multi_tensor_l2norm(grid, per_tensor=True)
    torch.save(dict(backend=ops.backend("cpu"), main=main, dst=dst, found_inf=found_inf, flags=flags,
                    total=total, each=each), OUT)
"""


def _spy_on_ext(monkeypatch):
    """Record the devices of the tensors each extension call got."""
    seen = []
    real = EXT.multi_tensor_l2norm

    def spy(tensors, per_tensor):
        seen.append(tensors[0].device.type)
        return real(tensors, per_tensor)

    monkeypatch.setattr(EXT, "multi_tensor_l2norm", spy)
    return seen


DEVICES = ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.skipif(EXT is None, reason="compiled extension not loaded")
@pytest.mark.parametrize("device", DEVICES)
def test_backend_names_the_implementation_that_runs(device, monkeypatch):
    """backend(device) says "<device>-ext" exactly when an op on that device runs the extension."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seen = _spy_on_ext(monkeypatch)
    total, _ = ops.multi_tensor_l2norm([torch.ones(4, device=device)])
    assert total.device.type == device
    ran_ext = seen == [device]
    assert ops.backend(device) == (f"{device}-ext" if ran_ext else "torch")
    assert ran_ext == (device == "cpu" or (device == "cuda" and EXT.WITH_CUDA))
    assert ops.extension_error() is None and ops.extension_path().endswith(".so")


@pytest.mark.slow
@pytest.mark.skipif(EXT is None, reason="compiled extension not loaded")
def test_disable_env_var_forces_fallback_with_matching_results(tmp_path):
    """The workload runs here on the extension and in a fresh interpreter with the env var set."""
    out = tmp_path / "torch.pt"
    _run(f"OUT = {str(out)!r}\n" + textwrap.dedent(_WORKLOAD), tmp_path, LIGHTNING_AMP_DISABLE_EXT="1")
    ref = torch.load(out)
    scope = {"OUT": tmp_path / "ext.pt"}
    exec(textwrap.dedent(_WORKLOAD), scope)
    ext = torch.load(scope["OUT"])
    assert ext["backend"] == "cpu-ext" and ref["backend"] == "torch"
    # main + g^T x: the same 111 exact bf16 products and main's value summed in fp32, in this CPU's GEMM order vs the
    # fallback's matmul: within twice the rounding bound of each element's sum (one token's products: ~500x it)
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(3, 37, 129, generator=gen).bfloat16().double().reshape(-1, 129)
    g = torch.randn(3, 37, 65, generator=gen).bfloat16().double().reshape(-1, 65)
    main = torch.randn(65, 129, generator=gen).double()
    bound = two_orders_apart(main.abs() + g.abs().t() @ x.abs(), x.shape[0] + 1)
    assert ((ext["main"].double() - ref["main"].double()).abs() <= bound).all()
    assert (ref["main"].double().abs() > 100 * bound).any()  # the bound lies far below the values
    for a, b in zip(ext["dst"], ref["dst"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert ext["found_inf"].item() == ref["found_inf"].item() == 1.0
    assert ext["flags"].tolist() == ref["flags"].tolist() == [0.0, 0.0, 1.0]
    # exact sums of squares (see _WORKLOAD): each norm is one correctly rounded square root of the same value, bit for
    # bit on any CPU; the fallback's total is the norm of those rounded norms: a few roundings of ~1 each (5u)
    assert torch.equal(ext["each"], ref["each"])
    torch.testing.assert_close(ext["total"], ref["total"], rtol=gamma(5), atol=0)


def test_disable_env_var_is_read_at_import(monkeypatch):
    monkeypatch.setenv("LIGHTNING_AMP_DISABLE_EXT", "1")
    probe = fresh_ops_module("lamp_ops_disabled_probe")
    assert probe.backend("cpu") == "torch"
    assert "LIGHTNING_AMP_DISABLE_EXT" in probe.extension_error()


def _no_first_use_build(monkeypatch, tmp_path):
    """The loader's next resort after the package's own _C, a first-use build, finds an empty cache and
    may not compile (LIGHTNING_AMP_NO_BUILD=1; tests/ops/test_ops_build.py covers that path)."""
    monkeypatch.setenv("LIGHTNING_AMP_NO_BUILD", "1")
    monkeypatch.setenv("LIGHTNING_AMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


def test_built_but_unloadable_extension_is_loud(monkeypatch, capsys, tmp_path):
    """An extension file that exists but does not load: the warning and `lightning-amp info` carry
    the loader's error; LIGHTNING_AMP_REQUIRE_EXT=1 turns it into an ImportError."""
    import lightning_amp
    from lightning_amp import cli

    monkeypatch.delenv("LIGHTNING_AMP_DISABLE_EXT", raising=False)
    monkeypatch.delenv("LIGHTNING_AMP_REQUIRE_EXT", raising=False)
    _no_first_use_build(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "lightning_amp._C", None)  # the import fails as a bad .so would
    monkeypatch.delattr(lightning_amp, "_C", raising=False)
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/pkg/lightning_amp/_C.cpython-311-x86_64-linux-gnu.so"]
                        if pattern.endswith(".so") else [])
    with pytest.warns(RuntimeWarning, match=r"_C\.cpython-311-x86_64-linux-gnu\.so is built but failed to load: "
                                             r"import of lightning_amp\._C halted"):
        probe = fresh_ops_module("lamp_ops_unloadable_probe")
    assert probe.backend("cpu") == "torch"
    monkeypatch.setattr(ops._ext, "_EXT", None)
    monkeypatch.setattr(ops._ext, "_EXT_ERROR", probe.extension_error())
    assert cli.main(["info"]) == 0
    assert "compiled extension: NOT in use: lightning_amp/_C.cpython-311-x86_64-linux-gnu.so is built but failed to " \
           "load: import of lightning_amp._C halted" in capsys.readouterr().out
    monkeypatch.setenv("LIGHTNING_AMP_REQUIRE_EXT", "1")
    with pytest.raises(ImportError, match=r"LIGHTNING_AMP_REQUIRE_EXT=1 but lightning_amp/_C\.cpython-311.*\.so "
                                          r"is built but failed to load: import of lightning_amp\._C halted"):
        fresh_ops_module("lamp_ops_required_probe")


def test_require_env_var_fails_import_of_the_package(tmp_path):
    """End to end in a fresh interpreter: `import lightning_amp` raises, nothing falls back."""
    code = """
        import sys
        sys.modules["lightning_amp._C"] = None
        try:
            import lightning_amp
        except ImportError as err:
            assert "LIGHTNING_AMP_REQUIRE_EXT=1" in str(err), err
        else:
            raise SystemExit("imported without the extension")
    """
    _run(code, tmp_path, LIGHTNING_AMP_REQUIRE_EXT="1", LIGHTNING_AMP_DISABLE_EXT="0", LIGHTNING_AMP_NO_BUILD="1",
         LIGHTNING_AMP_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path))


def test_info_names_the_loaded_extension(capsys):
    from lightning_amp import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    if EXT is not None:
        assert f"compiled extension: loaded from {EXT.__file__} ({ops.extension_origin()})" in out
    else:
        assert f"compiled extension: NOT in use: {ops.extension_error()}" in out


def test_missing_extension_warns_once_and_ops_still_work(monkeypatch, tmp_path):
    import lightning_amp

    monkeypatch.delenv("LIGHTNING_AMP_DISABLE_EXT", raising=False)
    monkeypatch.delenv("LIGHTNING_AMP_REQUIRE_EXT", raising=False)
    _no_first_use_build(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "lightning_amp._C", None)  # `from lightning_amp import _C` -> ImportError
    monkeypatch.delattr(lightning_amp, "_C", raising=False)
    monkeypatch.setattr(glob, "glob", lambda pattern: [])  # no file: "not built"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = fresh_ops_module("lamp_ops_missing_probe")
    msgs = [str(w.message) for w in caught if "lightning_amp._C is not built" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert probe.backend("cpu") == "torch" and probe.extension_error()
    x, g, main = torch.ones(4, 3), torch.ones(4, 2), torch.zeros(2, 3)
    probe.wgrad_gemm_accum_fp32(x, g, main)
    assert torch.equal(main, torch.full((2, 3), 4.0))
    found_inf, flags = probe.multi_tensor_scale([torch.tensor([1.0, float("inf")])], [torch.empty(2)], 2.0, True)
    assert found_inf.item() == 1.0 and flags.tolist() == [1.0]
