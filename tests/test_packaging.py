"""What a release holds: the sdist carries every file the extension's build reads (CPU and CUDA, whatever
torch builds it) and compiles from a bare unpacked copy; the wheel carries the sources inside the package.

The user's path end to end (pip's default isolated install of the sdist, first import building, a torch
switch, a machine without a compiler) is `.ci/install-check`.
"""
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

import lightning_amp

ROOT = pathlib.Path(lightning_amp.__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="needs the source tree")


def _tracked_sources() -> set:
    """csrc/ as git tracks it (what the sdist must hold), falling back to the folder's files."""
    done = subprocess.run(["git", "ls-files", "csrc"], cwd=ROOT, capture_output=True, text=True)
    files = done.stdout.split() if done.returncode == 0 else []
    return set(files) or {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}


def _build_dist(kind: str, out: pathlib.Path, **env) -> pathlib.Path:
    """``python -m build --<kind>`` of the tree without isolation (the isolated build is .ci/install-check's)."""
    done = subprocess.run([sys.executable, "-m", "build", f"--{kind}", "--no-isolation", "--outdir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (dist,) = out.glob("*.tar.gz" if kind == "sdist" else "*.whl")
    return dist


@pytest.fixture(scope="module")
def unpacked_sdist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("sdist")
    sdist = _build_dist("sdist", out)
    with tarfile.open(sdist) as tar:
        tar.extractall(out, filter="data")
    (tree,) = [p for p in out.iterdir() if p.is_dir()]
    return tree


@pytest.mark.slow
@pytest.mark.post_suite
def test_sdist_holds_every_source_and_no_build(unpacked_sdist):
    shipped = {str(p.relative_to(unpacked_sdist)) for p in unpacked_sdist.rglob("*") if p.is_file()}
    sources = _tracked_sources()
    assert {"csrc/checks.h", "csrc/cpu/multi_tensor_apply.h", "csrc/cuda/multi_tensor_apply.cuh"} <= sources
    assert sources <= shipped, sorted(sources - shipped)
    assert {"LICENSE", "setup.py", "pyproject.toml", "lightning_amp/ops/_build.py"} <= shipped
    assert not [p for p in shipped if p.endswith((".so", ".o", ".pyc")) or p.endswith("_C.build.json")]
    assert "Apache License" in (unpacked_sdist / "LICENSE").read_text()[:200]


def test_wheel_carries_the_sources_in_the_package(tmp_path):
    """A wheel built without compiling (as an isolated build makes it) is pure Python and holds csrc/ as
    lightning_amp/_csrc/, what the first-use build compiles; its metadata names the license and Python."""
    wheel = _build_dist("wheel", tmp_path, LIGHTNING_AMP_NO_EXT="1")
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    packaged = {n.replace("lightning_amp/_csrc/", "csrc/", 1) for n in names if n.startswith("lightning_amp/_csrc/")}
    assert packaged == _tracked_sources()
    assert not [n for n in names if n.endswith((".so", "_C.build.json"))]
    assert not [n for n in names if n.startswith("gpu_check/") or os.path.basename(n).startswith("gpu_")]
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta and "Requires-Python: >=3.11" in meta
    assert f"Version: {lightning_amp.__version__}" in meta


def test_the_gpu_check_tooling_is_in_no_wheel():
    """``make gpu-check``'s tooling, the package gpu_check/ at the root (once ``gpu_*.py`` modules of
    lightning_amp's bench folder), is not what setuptools packages: pyproject.toml's find config, read as
    setuptools reads it, yields no gpu_check package, and no packaged folder holds a ``gpu_*.py`` module. (The
    built wheel's file list is checked for both in test_wheel_carries_the_sources_in_the_package.)"""
    from setuptools import find_packages
    from setuptools.config.pyprojecttoml import read_configuration

    assert "gpu_check" in find_packages(str(ROOT))  # a package setuptools would find, were it not left out
    packages = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"]
    assert {"lightning_amp", "lightning_amp.bench"} <= set(packages)
    assert not [p for p in packages if p.split(".")[0] != "lightning_amp"], packages
    modules = [str(f.relative_to(ROOT)) for p in packages for f in (ROOT / p.replace(".", "/")).glob("*.py")]
    assert "lightning_amp/bench/runner.py" in modules
    assert not [m for m in modules if os.path.basename(m).startswith("gpu_")]


@pytest.mark.slow
@pytest.mark.post_suite
def test_unpacked_sdist_builds_at_first_import_and_caches(unpacked_sdist, tmp_path):
    """The bare unpacked sdist (no prebuilt extension) imported twice with an empty cache: the first
    import compiles (CPU, -O0 to keep it short) and runs the compiled kernels, the second loads that build."""
    # the sdist first; what the environment adds (the test dependencies of the torch-floor lane) after it
    path = os.pathsep.join(filter(None, [str(unpacked_sdist), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "LIGHTNING_AMP_CACHE_DIR": str(tmp_path / "cache"),
           "LIGHTNING_AMP_OPT": "-O0", "LIGHTNING_AMP_CPU_ONLY": "1", "LIGHTNING_AMP_REQUIRE_EXT": "1"}
    for name in ("LIGHTNING_AMP_DISABLE_EXT", "LIGHTNING_AMP_NO_BUILD"):
        env.pop(name, None)
    probe = ("import lightning_amp.ops as o, torch; "
             "t, _ = o.multi_tensor_l2norm([torch.full((5,), 2.0)]); "
             "print(o.backend('cpu'), o.extension_path(), o.extension_origin(), t.item())")
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(done)
    first, second = runs
    backend, path, *_, norm = first.stdout.split()
    assert backend == "cpu-ext" and path.startswith(str(tmp_path / "cache")) and abs(float(norm) - 20 ** 0.5) < 1e-5
    assert "first-use build from the per-user cache" in first.stdout
    assert "lightning_amp: building the compiled kernels for torch" in first.stderr and "built in" in first.stderr
    assert second.stdout == first.stdout and "building" not in second.stderr
