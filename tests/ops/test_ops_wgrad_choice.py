"""The CPU wgrad GEMM path of a machine (lightning_amp/ops/_wgrad_choice.py): measured once, cached beside
the build, the same in every process; the CPU's rule where the cache can be neither read nor written."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_amp import ops
from lightning_amp.ops import _wgrad_choice

EXT = ops._ext_for("cpu")
pytestmark = pytest.mark.skipif(EXT is None, reason=f"compiled extension not loaded: {ops.extension_error()}")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _rule(name):
    """The path "auto" takes without a measured choice (tests/ops/test_ops_wgrad.py: ``_auto_rule``)."""
    why = dict(EXT._wgrad_cpu_gemm_paths(name))
    if not why["onednn"] or why["onednn"].startswith("oneDNN is disabled"):
        return next((p for p in ("mkl", "onednn") if not why[p]), "aten")
    return "aten"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache file for this test; afterwards the process decides again from the real one."""
    path = tmp_path / _wgrad_choice.CACHE_NAME
    monkeypatch.setattr(_wgrad_choice, "cache_path", lambda ext: str(path))
    monkeypatch.setattr(ops._ext, "_WGRAD_CPU_GEMM_POLICY", "auto")
    _wgrad_choice.forget()
    yield path
    _wgrad_choice.forget()
    for name in DTYPES:
        EXT._set_wgrad_cpu_gemm_choice(name, "")


@pytest.mark.parametrize("name", list(DTYPES))
def test_first_call_measures_writes_the_cache_and_later_processes_read_it(cache, monkeypatch, name):
    dtype = DTYPES[name]
    usable = sorted(p for p, why in EXT._wgrad_cpu_gemm_paths(name) if not why)
    x, g = torch.randn(40, 24).to(dtype), torch.randn(40, 16).to(dtype)
    main = torch.randn(16, 24)
    ref = main.double() + g.double().t() @ x.double()
    ops.wgrad_gemm_accum_fp32(x, g, main)  # the first 16-bit call decides
    assert ((main.double() - ref).norm() / ref.norm()).item() < 1e-5
    entry = json.loads(cache.read_text())[_wgrad_choice.machine_key()][name]
    assert sorted(entry["ms"]) == usable and entry["path"] == min(entry["ms"], key=entry["ms"].get)
    assert EXT._wgrad_cpu_gemm_choice(name) == entry["path"] == ops.wgrad_cpu_gemm(dtype)
    assert ops.wgrad_cpu_gemm_origin(dtype).startswith("measured on this machine now")
    # a later process (simulated: decisions forgotten) reads the entry and never measures
    _wgrad_choice.forget()
    EXT._set_wgrad_cpu_gemm_choice(name, "")
    monkeypatch.setattr(_wgrad_choice, "_measure", lambda *a: pytest.fail("measured a second time"))
    assert ops.wgrad_cpu_gemm(dtype) == entry["path"]
    assert ops.wgrad_cpu_gemm_origin(dtype).startswith("measured on this machine (")


def test_a_cached_entry_is_obeyed_and_a_switched_off_path_falls_back_to_the_rule(cache):
    """The entry decides (here: "aten", usable everywhere), per dtype; a path the process cannot use now
    (oneDNN switched off) gives way to the rule, not to an error."""
    key = _wgrad_choice.machine_key()
    cache.write_text(json.dumps({key: {"bfloat16": {"path": "aten", "ms": {"aten": 1.0}}}}))
    assert ops.wgrad_cpu_gemm(torch.bfloat16) == "aten"
    EXT._set_wgrad_cpu_gemm_choice("bfloat16", "onednn")
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        assert EXT._wgrad_cpu_gemm_backend("bfloat16") == _rule("bfloat16") != "onednn"
    finally:
        torch.backends.mkldnn.enabled = enabled
    with pytest.raises(ValueError, match="'onednn', 'mkl', 'aten' or ''"):
        EXT._set_wgrad_cpu_gemm_choice("bfloat16", "fast")
    with pytest.raises(ValueError, match="only bfloat16 and float16"):
        EXT._set_wgrad_cpu_gemm_choice("float32", "aten")


def test_an_entry_of_another_machine_or_isa_cap_is_not_taken(cache, monkeypatch):
    """The key names the CPU's ISA caps: a process with oneDNN capped measures for itself."""
    for name in _wgrad_choice._ISA_CAPS:  # whatever caps the suite runs under (ATEN_CPU_CAPABILITY=avx2 in a lane)
        monkeypatch.delenv(name, raising=False)
    plain = _wgrad_choice.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = _wgrad_choice.machine_key()
    assert capped != plain and json.loads(capped)["caps"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    cache.write_text(json.dumps({plain: {"bfloat16": {"path": "aten", "ms": {}}}}))
    measured = []
    monkeypatch.setattr(_wgrad_choice, "_measure",
                        lambda ext, name: measured.append(name) or {"path": "aten", "ms": {"aten": 2.0}})
    ops.wgrad_cpu_gemm(torch.bfloat16)
    assert measured == ["bfloat16"] and set(json.loads(cache.read_text())) == {plain, capped}


def test_an_unwritable_cache_leaves_the_cpus_rule(tmp_path, cache, monkeypatch):
    missing = tmp_path / "no-such-folder" / _wgrad_choice.CACHE_NAME
    monkeypatch.setattr(_wgrad_choice, "cache_path", lambda ext: str(missing))
    EXT._set_wgrad_cpu_gemm_choice("bfloat16", "aten")  # whatever was set before
    assert ops.wgrad_cpu_gemm(torch.bfloat16) == _rule("bfloat16")
    assert EXT._wgrad_cpu_gemm_choice("bfloat16") == ""
    origin = ops.wgrad_cpu_gemm_origin(torch.bfloat16)
    assert origin.startswith("the CPU's rule") and "cannot be written" in origin and str(missing) in origin


def test_an_unknown_path_in_the_cache_leaves_the_rule(cache):
    cache.write_text(json.dumps({_wgrad_choice.machine_key(): {"bfloat16": {"path": "blas9000", "ms": {}}}}))
    assert ops.wgrad_cpu_gemm(torch.bfloat16) == _rule("bfloat16")
    assert "unknown path 'blas9000'" in ops.wgrad_cpu_gemm_origin(torch.bfloat16)


def test_a_pinned_policy_measures_nothing(cache, monkeypatch):
    monkeypatch.setattr(ops._ext, "_WGRAD_CPU_GEMM_POLICY", "aten")
    monkeypatch.setattr(_wgrad_choice, "_measure", lambda *a: pytest.fail("measured under a pinned policy"))
    EXT._set_wgrad_cpu_gemm_policy("aten")
    try:
        assert ops.wgrad_cpu_gemm(torch.bfloat16) == "aten"
        assert ops.wgrad_cpu_gemm_origin(torch.bfloat16) == "LIGHTNING_AMP_WGRAD_CPU_GEMM=aten"
    finally:
        EXT._set_wgrad_cpu_gemm_policy("auto")
    assert not cache.exists()


_PROCESS = """
import sys, torch
from lightning_amp import ops
from lightning_amp.ops import _wgrad_choice
_wgrad_choice.cache_path = lambda ext: sys.argv[1]
x, g, main = torch.randn(64, 32).bfloat16(), torch.randn(64, 48).bfloat16(), torch.zeros(48, 32)
ops.wgrad_gemm_accum_fp32(x, g, main)
print("PATH", ops.wgrad_cpu_gemm(torch.bfloat16), "|", ops.wgrad_cpu_gemm_origin(torch.bfloat16))
"""


@pytest.mark.slow
def test_two_processes_started_together_take_the_same_path(tmp_path):
    """Two processes (two ranks of one machine) whose first bf16 call finds no cache: one measures under
    the lock and writes, the other waits and reads that answer; both then sum in the same order."""
    path = tmp_path / _wgrad_choice.CACHE_NAME
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_AMP_WGRAD_CPU_GEMM"}
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, str(path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    lines = [next(line for line in out.splitlines() if line.startswith("PATH ")) for out, _ in outs]
    chosen = {line.split()[1] for line in lines}
    entry = json.loads(path.read_text())
    (key,) = entry
    assert chosen == {entry[key]["bfloat16"]["path"]}, lines
    assert sum("measured on this machine now" in line for line in lines) == 1, lines
