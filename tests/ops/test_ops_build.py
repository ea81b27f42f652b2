"""The first-use build of the compiled core (lightning_amp/ops/_build.py) and how the loader uses it.

No test here compiles the kernels (tests/test_packaging.py does, once): the cache, the lock and the
recovery from killed or half-written builds run a stand-in ``compile_into`` that writes the files.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from torch.utils import cpp_extension

from lightning_amp import ops
from lightning_amp.ops import _build
from support.fresh_ops import fresh_ops_module

KEY = _build.BuildKey("torch0.0-test-py311-0123456789abcdef", {"torch": "0.0", "with_cuda": False})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache, and an empty temporary folder for the unwritable-cache fallback."""
    monkeypatch.setenv("LIGHTNING_AMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    return tmp_path / "cache"


def _fake_compile(calls):
    def compile_into(folder):
        calls.append(folder)
        with open(os.path.join(folder, _build.LIBRARY), "w") as f:
            f.write("not a library")
    return compile_into


def _sources_copy(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(_build.TREE_SOURCES if os.path.isdir(_build.TREE_SOURCES) else _build.source_dir(), root)
    return str(root)


def test_key_names_torch_cuda_arch_and_sources(tmp_path, monkeypatch):
    """Same inputs, same key; a changed header, torch release, C++ ABI or GPU architecture list, another key."""
    root = _sources_copy(tmp_path)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("LIGHTNING_AMP_CPU_ONLY", "1")
    base = _build.build_key(root)
    assert _build.build_key(root) == base
    assert base.fields["torch"] == torch.__version__ and base.name.startswith(f"torch{torch.__version__.replace('+', '_')}-")
    names = {base.name}

    with open(os.path.join(root, "checks.h"), "a") as f:
        f.write("\n// changed\n")
    names.add(_build.build_key(root).name)

    real_identity = _build.runtime_identity
    monkeypatch.setattr(_build, "runtime_identity", lambda: {**real_identity(), "torch": "2.11.0"})
    names.add(_build.build_key(root).name)
    monkeypatch.setattr(_build, "runtime_identity", lambda: {**real_identity(), "torch": "2.11.0", "cxx11_abi": False})
    names.add(_build.build_key(root).name)

    monkeypatch.delenv("LIGHTNING_AMP_CPU_ONLY")  # a CUDA build: the arch list is part of the key
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    for arch in ("8.0", "9.0"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
        key = _build.build_key(root)
        assert key.fields["with_cuda"] and key.fields["cuda_arch"] == arch and "-cu13.0-" in key.name
        names.add(key.name)
    assert len(names) == 6, names


def test_build_is_cached_and_announced(cache):
    calls, said = [], []
    first = _build.ensure_build(KEY, _fake_compile(calls), say=said.append)
    assert first.built and first.library == str(cache / KEY.name / _build.LIBRARY)
    assert said[0].startswith("building the compiled kernels for torch 0.0 (CPU) into ") and said[1].startswith("built in ")
    again = _build.ensure_build(KEY, _fake_compile(calls), say=said.append)
    assert not again.built and again.library == first.library and len(calls) == 1 and len(said) == 2
    assert _build.find_build(KEY) == first.library
    assert not [p for p in os.listdir(cache) if ".tmp-" in p]


def test_half_written_build_is_rebuilt(cache):
    """A key folder without its record (copied half, or by a build without atomic publication) is not
    used: it is removed, with a message, and built again."""
    folder = cache / KEY.name
    folder.mkdir(parents=True)
    (folder / _build.LIBRARY).write_text("truncated")
    assert _build.find_build(KEY) is None
    calls, said = [], []
    done = _build.ensure_build(KEY, _fake_compile(calls), say=said.append)
    assert done.built and len(calls) == 1 and any(f"removing an incomplete build {folder}" in m for m in said)
    assert _build.find_build(KEY) == done.library


_HOLDER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("b", sys.argv[1])
b = sys.modules["b"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
key = b.BuildKey(sys.argv[2], {"torch": "0.0", "with_cuda": False})
def compile_into(folder):
    with open(os.path.join(folder, "half.o"), "w") as f:
        f.write("partial")
    with open(sys.argv[3], "a") as f:
        f.write("compiling\\n")
    time.sleep(float(sys.argv[4]))
    with open(os.path.join(folder, b.LIBRARY), "w") as f:
        f.write("library")
print(b.ensure_build(key, compile_into).library, flush=True)
"""


def _start_builder(tmp_path, seconds):
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    return subprocess.Popen([sys.executable, str(script), _build.__file__, KEY.name, str(tmp_path / "compiles.txt"),
                             str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)


def _wait_until_compiling(tmp_path, proc):
    for _ in range(200):
        if (tmp_path / "compiles.txt").exists():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the builder never started compiling")


def test_concurrent_builders_compile_once(cache, tmp_path):
    """Two processes (DDP ranks) ask for the same build: one compiles, the other waits on the lock and
    gets the same library."""
    first = _start_builder(tmp_path, 1.5)
    _wait_until_compiling(tmp_path, first)
    second = _start_builder(tmp_path, 1.5)
    out1, err1 = first.communicate(timeout=60)
    out2, err2 = second.communicate(timeout=60)
    assert first.returncode == second.returncode == 0, (err1, err2)
    assert out1 == out2 == f"{cache / KEY.name / _build.LIBRARY}\n"
    assert (tmp_path / "compiles.txt").read_text() == "compiling\n"
    assert "waiting for another process building" in err2 and "built in" in err1 and "built in" not in err2


def test_killed_builder_leaves_no_lock_and_its_leftovers_are_removed(cache, tmp_path):
    """A builder killed mid-compile (SIGKILL: no cleanup ran) holds no lock afterwards, and its
    half-written folder is never taken for a build."""
    proc = _start_builder(tmp_path, 60)
    _wait_until_compiling(tmp_path, proc)
    leftovers = [p for p in os.listdir(cache) if p.startswith(KEY.name + ".tmp-")]
    assert len(leftovers) == 1 and (cache / leftovers[0] / "half.o").exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert _build.find_build(KEY) is None and (cache / (KEY.name + ".lock")).exists()
    calls, said = [], []
    started = time.perf_counter()
    done = _build.ensure_build(KEY, _fake_compile(calls), say=said.append)
    assert time.perf_counter() - started < 5  # the dead holder's lock did not block
    assert done.built and len(calls) == 1 and open(done.library).read() == "not a library"
    assert any(f"removing an incomplete build {cache / leftovers[0]}" in m for m in said)
    assert not (cache / leftovers[0]).exists()


def test_failed_build_leaves_nothing_to_load(cache):
    def failing(folder):
        with open(os.path.join(folder, "half.o"), "w") as f:
            f.write("x")
        raise _build.BuildError("compiler said no")

    with pytest.raises(_build.BuildError, match="compiler said no"):
        _build.ensure_build(KEY, failing, say=lambda m: None)
    assert _build.find_build(KEY) is None and not [p for p in os.listdir(cache) if ".tmp-" in p]


def test_unwritable_cache_builds_in_a_temporary_folder(tmp_path, monkeypatch):
    """LIGHTNING_AMP_CACHE_DIR below a regular file cannot be created (root included): the build goes to
    the per-user temporary folder with a message naming both, and is found there next time."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LIGHTNING_AMP_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    calls, said = [], []
    done = _build.ensure_build(KEY, _fake_compile(calls), say=said.append)
    fallback = tmp_path / f"lightning_amp-{os.getuid()}"
    assert done.library == str(fallback / KEY.name / _build.LIBRARY)
    assert said[0].startswith(f"cache folder {blocker / 'cache'} cannot be written (") and str(fallback) in said[0]
    assert _build.find_build(KEY) == done.library


def _unloadable_prebuilt(monkeypatch, cache_dir, **env):
    """The package's own _C cannot load, the cache is empty: what the loader falls to is the first-use build."""
    import lightning_amp

    monkeypatch.delenv("LIGHTNING_AMP_DISABLE_EXT", raising=False)
    monkeypatch.delenv("LIGHTNING_AMP_REQUIRE_EXT", raising=False)
    monkeypatch.delenv("LIGHTNING_AMP_NO_BUILD", raising=False)
    monkeypatch.setitem(sys.modules, "lightning_amp._C", None)
    monkeypatch.delattr(lightning_amp, "_C", raising=False)
    monkeypatch.setenv("LIGHTNING_AMP_CACHE_DIR", str(cache_dir))
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_no_compiler_falls_back_loudly(cache, monkeypatch):
    _unloadable_prebuilt(monkeypatch, cache, CXX="/nonexistent/g++")
    with pytest.warns(RuntimeWarning, match=r"is built but failed to load: .*; no C\+\+ compiler found "
                                            r"\(CXX='/nonexistent/g\+\+' is not on PATH\); install g\+\+"):
        probe = fresh_ops_module("lamp_ops_no_compiler_probe")
    assert probe.backend("cpu") == "torch" and "no C++ compiler found" in probe.extension_error()
    monkeypatch.setenv("LIGHTNING_AMP_REQUIRE_EXT", "1")
    with pytest.raises(ImportError, match=r"LIGHTNING_AMP_REQUIRE_EXT=1 but .*no C\+\+ compiler found"):
        fresh_ops_module("lamp_ops_no_compiler_required_probe")


def test_failing_compiler_falls_back_loudly_naming_the_log(cache, monkeypatch, capfd):
    """A compiler that runs but fails (here /bin/false): the warning names the kept log, nothing is cached."""
    _unloadable_prebuilt(monkeypatch, cache, CXX="/bin/false", MAX_JOBS="1")
    with pytest.warns(RuntimeWarning, match=r"building the compiled kernels failed \(exit 1; log .*\.failed\.log\)"):
        probe = fresh_ops_module("lamp_ops_failing_compiler_probe")
    assert probe.backend("cpu") == "torch"
    assert "lightning_amp: building the compiled kernels for torch" in capfd.readouterr().err
    logs = [p for p in os.listdir(cache) if p.endswith(".failed.log")]
    assert len(logs) == 1 and os.path.getsize(cache / logs[0]) > 0
    assert not [p for p in os.listdir(cache) if not p.endswith((".failed.log", ".lock"))]


def test_no_build_switch_loads_only_what_is_built(cache, monkeypatch):
    _unloadable_prebuilt(monkeypatch, cache, LIGHTNING_AMP_NO_BUILD="1")
    with pytest.warns(RuntimeWarning, match=r"no cached build for torch .* and LIGHTNING_AMP_NO_BUILD=1"):
        probe = fresh_ops_module("lamp_ops_no_build_probe")
    assert probe.backend("cpu") == "torch" and not cache.exists()


@pytest.mark.skipif(ops._ext_for("cpu") is None, reason="compiled extension not loaded")
def test_prebuilt_for_another_torch_or_other_sources_is_not_loaded(tmp_path, monkeypatch):
    """A prebuilt extension whose record names another torch, or other sources than those beside the package
    (a tree pulled after ``make install``), is refused before it is loaded; one whose record matches is used."""
    package = tmp_path / "lightning_amp"
    package.mkdir()
    shutil.copy(ops.extension_path(), package / "_C.cpython-311-x86_64-linux-gnu.so")
    monkeypatch.setattr(ops._ext._build, "PACKAGE_DIR", str(package))
    here = _build.runtime_identity()
    (package / _build.BUILD_RECORD).write_text(f'{{"torch": "2.11.0", "cuda": "13.0", "cxx11_abi": true, '
                                               f'"python": "{here["python"]}"}}')
    module, why, origin = ops._ext._load_prebuilt()
    assert module is None and origin is None
    assert why == (f"lightning_amp/_C.cpython-311-x86_64-linux-gnu.so was built for torch 2.11.0 (CUDA 13.0, "
                   f"C++11 ABI True, {here['python']}), this is {ops._ext._describe_identity(here)}")
    import json
    root = _build.source_dir()
    for stale in ({}, {"sources": "0" * 64}):  # a record from before sources were recorded; an older tree
        (package / _build.BUILD_RECORD).write_text(json.dumps({**here, **stale}))
        module, why, origin = ops._ext._load_prebuilt()
        assert module is None and origin is None
        assert why == (f"lightning_amp/_C.cpython-311-x86_64-linux-gnu.so was built from other sources than those in "
                       f"{root} (rebuild it: `make install` or `pip install --no-build-isolation -e .`)")
    (package / _build.BUILD_RECORD).write_text(json.dumps({**here, "sources": _build.sources_digest(root)}))
    module, why, origin = ops._ext._load_prebuilt()
    assert module is ops.extension_module() and why is None and origin == "prebuilt by setup.py for this torch"


def test_sources_are_found_in_the_tree_or_the_package():
    root = _build.source_dir()
    assert root in (_build.PACKAGED_SOURCES, _build.TREE_SOURCES)
    files = _build.source_files(root)
    assert "bindings.cpp" in files and "checks.h" in files and "cuda/multi_tensor_apply.cuh" in files
    assert set(_build.compiled_sources(root, with_cuda=False)) < set(_build.compiled_sources(root, with_cuda=True))


_OTHER_VALUES = {"torch": "2.11.0", "cuda": "12.4", "cxx11_abi": None, "python": ".cpython-310-x86_64-linux-gnu.so"}


def test_every_field_of_the_prebuilt_record_is_varied_below():
    assert set(_OTHER_VALUES) == set(_build.runtime_identity())


@pytest.mark.skipif(ops._ext_for("cpu") is None, reason="compiled extension not loaded")
@pytest.mark.parametrize("field", sorted(_OTHER_VALUES))
def test_a_prebuilt_record_differing_in_any_one_field_is_not_loaded(tmp_path, monkeypatch, field):
    """Each field of what the extension was built for, alone (the others and the sources matching), refuses it."""
    import json

    package = tmp_path / "lightning_amp"
    package.mkdir()
    shutil.copy(ops.extension_path(), package / "_C.cpython-311-x86_64-linux-gnu.so")
    monkeypatch.setattr(ops._ext._build, "PACKAGE_DIR", str(package))
    here = _build.runtime_identity()
    other = not here["cxx11_abi"] if field == "cxx11_abi" else _OTHER_VALUES[field]
    assert other != here[field]
    record = {**here, field: other, "sources": _build.sources_digest(_build.source_dir())}
    (package / _build.BUILD_RECORD).write_text(json.dumps(record))
    module, why, origin = ops._ext._load_prebuilt()
    assert module is None and origin is None
    assert why == (f"lightning_amp/_C.cpython-311-x86_64-linux-gnu.so was built for {ops._ext._describe_identity(record)}, "
                   f"this is {ops._ext._describe_identity(here)}")
