"""Building the compiled core ``lightning_amp._C``: the one description of the build (sources, flags) that
``setup.py`` and the first-use build share, what a build is made for, and the per-user cache of first-use builds.

Importable without torch and without the package (``setup.py`` loads this file by path): torch is
imported inside the functions that need it.

The cache: ``$LIGHTNING_AMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_amp``, else
``~/.cache/lightning_amp``; one folder per :func:`build_key` (torch version, CUDA version, C++ ABI,
Python, GPU architectures, CPU vector ISA, flags and a hash of the sources). A build runs in a
fresh interpreter into ``<key>.tmp-*`` under an ``fcntl`` lock on ``<key>.lock`` and is renamed to
``<key>`` when complete, so a folder named by its key is whole; the lock dies with a killed process,
and the next builder removes what that process left.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

class BuildError(RuntimeError):
    """A first-use build that cannot run or failed; the message says why (and names the log)."""


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where a wheel carries the sources (setup.py's build_py copies csrc/ there); a source tree has them
# beside the package.
PACKAGED_SOURCES = os.path.join(PACKAGE_DIR, "_csrc")
TREE_SOURCES = os.path.join(os.path.dirname(PACKAGE_DIR), "csrc")
BUILD_RECORD = "_C.build.json"  # beside a prebuilt _C*.so: what it was built for (runtime_identity()), from what
LIBRARY = "_C.so"  # the name torch.utils.cpp_extension.load gives the module it builds
_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


def source_dir() -> Optional[str]:
    """The folder holding the C++/CUDA sources (``csrc/``'s contents), or None when none is shipped."""
    for root in (PACKAGED_SOURCES, TREE_SOURCES):
        if os.path.isfile(os.path.join(root, "bindings.cpp")):
            return root
    return None


def require_source_dir() -> str:
    """:func:`source_dir`, or :class:`BuildError` saying where none was found."""
    root = source_dir()
    if root is None:
        raise BuildError(f"no C++/CUDA sources to build from (neither {PACKAGED_SOURCES} nor {TREE_SOURCES} exists)")
    return root


def source_files(root: str) -> list:
    """Every file under ``root`` the build reads, as sorted paths relative to ``root``."""
    found = []
    for folder, _, names in os.walk(root):
        found += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(_SOURCE_SUFFIXES)]
    return sorted(found)


def sources_digest(root: str) -> str:
    """SHA-256 (hex) of every source file under ``root``, names and contents: which sources a build came from."""
    digest = hashlib.sha256()
    for rel in source_files(root):
        digest.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def compiled_sources(root: str, with_cuda: bool) -> list:
    """The translation units: the CPU ones always, the CUDA ones when ``with_cuda``."""
    cpu = sorted(glob.glob(os.path.join(root, "*.cpp")) + glob.glob(os.path.join(root, "cpu", "*.cpp")))
    cuda = sorted(glob.glob(os.path.join(root, "cuda", "*.cu")) + glob.glob(os.path.join(root, "cuda", "*.cpp")))
    return cpu + (cuda if with_cuda else [])


def has_cuda_sources(root: str) -> bool:
    return bool(glob.glob(os.path.join(root, "cuda", "*.cu")))


def cpu_vector_flags() -> list:
    """Compiler flags selecting ATen's vector implementation for this machine's CPU (none with
    ``LIGHTNING_AMP_PORTABLE=1``: baseline x86-64 code, for a build meant to be copied to other machines)."""
    if os.environ.get("LIGHTNING_AMP_PORTABLE") == "1" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return []
    # ATen's Vectorized<Half>/<BFloat16> convert through F16C intrinsics in both vector paths (as
    # ATen's own AVX2/AVX512 kernels are built with -mf16c): without the flag GCC refuses to inline them.
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= words:
        isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        return isa + ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma", "f16c"} <= words:
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def nvidia_wheel_cublas(cuda_home: str) -> Optional[tuple]:
    """(include dir, library dir, soname) of cuBLAS from torch's nvidia wheels, or None when
    the toolkit at cuda_home has cuBLAS itself (or no wheel provides it)."""
    if os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")):
        return None
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cu12", "cublas"):
            inc, lib = os.path.join(root, sub, "include"), os.path.join(root, sub, "lib")
            libs = sorted(glob.glob(os.path.join(lib, "libcublas.so.*")))
            if os.path.exists(os.path.join(inc, "cublas_v2.h")) and libs:
                return inc, lib, os.path.basename(libs[0])
    return None


def wants_cuda(root: str) -> bool:
    """CUDA kernels are built when torch is a CUDA build, nvcc is found (``CUDA_HOME``) and
    ``LIGHTNING_AMP_CPU_ONLY`` is not ``1``."""
    import torch

    if torch.version.cuda is None or os.environ.get("LIGHTNING_AMP_CPU_ONLY") == "1" or not has_cuda_sources(root):
        return False
    from torch.utils import cpp_extension  # imports setuptools: only where CUDA is in question

    return cpp_extension.CUDA_HOME is not None


@dataclass
class BuildOptions:
    """What the compiler is given; ``setup.py`` turns it into a Cpp/CUDAExtension, the first-use
    build into ``torch.utils.cpp_extension.load`` arguments."""
    sources: list
    include_dirs: list
    cxx: list
    nvcc: list = field(default_factory=list)
    with_cuda: bool = False
    library_dirs: list = field(default_factory=list)
    libraries: list = field(default_factory=list)
    extra_link_args: list = field(default_factory=list)


def build_options(root: str, with_cuda: bool) -> BuildOptions:
    """The compile and link flags. ``LIGHTNING_AMP_OPT`` sets the optimisation flag (default ``-O3``)."""
    opt = os.environ.get("LIGHTNING_AMP_OPT", "-O3")
    # No -std: torch's cpp_extension adds the C++ standard its own headers need (C++17 up to torch 2.12,
    # C++20 from 2.13; 2.14's headers refuse anything older).
    options = BuildOptions(sources=compiled_sources(root, with_cuda), include_dirs=[root],
                           cxx=[opt, "-fopenmp"] + cpu_vector_flags(), with_cuda=with_cuda)
    if with_cuda:
        from torch.utils import cpp_extension

        # No --use_fast_math: the inf/nan checks of the multi-tensor kernels must see inf and nan.
        options.nvcc = [opt]
        options.libraries = ["cublas"]
        wheel = nvidia_wheel_cublas(cpp_extension.CUDA_HOME)
        if wheel is not None:
            inc, lib, soname = wheel
            options.cxx += ["-idirafter", inc]
            options.nvcc += ["-Xcompiler", f"-idirafter{inc}"]
            options.libraries, options.library_dirs, options.extra_link_args = [], [lib], [f"-l:{soname}"]
    return options


def runtime_identity() -> dict:
    """What a compiled extension must have been built for to load here: torch release, CUDA
    version, C++ ABI and the Python extension ABI."""
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
            "python": sysconfig.get_config_var("EXT_SUFFIX")}


def target_cuda_archs() -> Optional[str]:
    """The GPU architectures a first-use CUDA build targets: ``TORCH_CUDA_ARCH_LIST`` when set, else those
    of the visible GPUs as ``nvidia-smi`` reports them (read without initialising CUDA in this process,
    which would stop Lightning from forking workers later), else ``auto`` (torch's own detection in the
    build) when torch sees a GPU; None when there is no GPU to build for (the CPU kernels only)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return ";".join(sorted({line.strip() for line in out.splitlines() if line.strip()})) or None
    except (OSError, subprocess.SubprocessError):
        import torch

        return "auto" if torch.cuda.is_available() else None


@dataclass
class BuildKey:
    """One build's identity: ``name`` is its cache folder, ``fields`` what went into it."""
    name: str
    fields: dict


def build_key(root: str) -> BuildKey:
    """The key of a first-use build from the sources in ``root`` for the running torch and this machine.
    It has CUDA kernels when :func:`wants_cuda` and there is a GPU architecture to build for."""
    import torch

    archs = target_cuda_archs() if wants_cuda(root) else None
    with_cuda = archs is not None
    options = build_options(root, with_cuda)
    digest = hashlib.sha256(sources_digest(root).encode())
    with open(os.path.abspath(__file__), "rb") as f:  # the flags are made here
        digest.update(f.read())
    fields = {**runtime_identity(), "with_cuda": with_cuda, "cuda_arch": archs,
              "cxx": options.cxx, "nvcc": options.nvcc, "compiler": os.environ.get("CXX", "c++"),
              "sources": digest.hexdigest()}
    whole = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    device = f"cu{torch.version.cuda}" if with_cuda else "cpu"
    return BuildKey(f"torch{torch.__version__.replace('+', '_')}-{device}-py{sys.version_info[0]}{sys.version_info[1]}"
                    f"-{whole}", fields)


def default_cache_root() -> str:
    explicit = os.environ.get("LIGHTNING_AMP_CACHE_DIR")
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightning_amp")


def _tmp_cache_root() -> str:
    return os.path.join(tempfile.gettempdir(), f"lightning_amp-{os.getuid()}")


def _usable(root: str) -> Optional[str]:
    """Why ``root`` cannot hold builds (None: it can): it must exist or be creatable, and be writable."""
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            pass
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    return None


def compiler_problem() -> Optional[str]:
    """Why no C++ compiler can build here (None: ``$CXX`` or ``c++`` is found), as torch's builder looks it up."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(shlex.split(cxx)[0] if cxx.strip() else "c++") is None:
        return f"no C++ compiler found (CXX={cxx!r} is not on PATH); install g++ (or set CXX)"
    return None


def complete_build(folder: str, key: BuildKey) -> Optional[str]:
    """The library in ``folder`` when the folder is a whole build for ``key``, else None."""
    try:
        with open(os.path.join(folder, "build.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    library = os.path.join(folder, LIBRARY)
    return library if record.get("key") == key.name and os.path.isfile(library) else None


@contextlib.contextmanager
def file_lock(path: str, on_wait: Callable[[], None]) -> Iterator[None]:
    """An exclusive ``fcntl`` lock on ``path`` (created if missing), held for the block. The kernel
    drops it when its holder exits, however it exits, so a lock file left behind blocks nobody."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _say(message: str) -> None:
    print(f"lightning_amp: {message}", file=sys.stderr, flush=True)


@dataclass
class CachedBuild:
    """A usable first-use build: the library's path, and whether this call compiled it."""
    library: str
    built: bool
    seconds: float = 0.0


def cache_roots() -> list:
    """Where builds are looked up, in order: the configured cache, then the per-user temporary folder
    that :func:`ensure_build` falls back to when the configured one cannot be written."""
    return [default_cache_root(), _tmp_cache_root()]


def find_build(key: BuildKey) -> Optional[str]:
    """A whole cached build for ``key`` in any of :func:`cache_roots`, or None."""
    for root in cache_roots():
        library = complete_build(os.path.join(root, key.name), key)
        if library:
            return library
    return None


def ensure_build(key: BuildKey, compile_into: Callable[[str], None], force: bool = False,
                 say: Callable[[str], None] = _say) -> CachedBuild:
    """The cached build for ``key``, compiling it with ``compile_into(folder)`` when there is none (or
    with ``force``). Concurrent callers (DDP ranks, workers) wait on the lock and reuse the result;
    an unwritable cache folder falls back to a per-user temporary one, with a message."""
    root = default_cache_root()
    problem = _usable(root)
    if problem is not None:
        fallback = _tmp_cache_root()
        say(f"cache folder {root} cannot be written ({problem}); building in {fallback} instead "
            "(set LIGHTNING_AMP_CACHE_DIR to choose)")
        root = fallback
        problem = _usable(root)
        if problem is not None:
            raise BuildError(f"no writable cache folder: {fallback}: {problem}")
    final = os.path.join(root, key.name)
    library = None if force else complete_build(final, key)
    if library:
        return CachedBuild(library, built=False)
    with file_lock(final + ".lock", lambda: say(f"waiting for another process building {final}")):
        library = None if force else complete_build(final, key)
        if library:  # another process built it while this one waited
            return CachedBuild(library, built=False)
        for leftover in sorted(glob.glob(final + ".tmp-*")) + ([final] if os.path.exists(final) else []):
            # Under the lock nobody else builds this key: what is there was left by a killed or older build.
            say(f"removing an incomplete build {leftover}")
            shutil.rmtree(leftover, ignore_errors=True)
        say(f"building the compiled kernels for {describe(key)} into {final} (once per torch, GPU and source "
            "version; minutes)")
        work = tempfile.mkdtemp(prefix=key.name + ".tmp-", dir=root)
        started = time.perf_counter()
        try:
            compile_into(work)
            with open(os.path.join(work, "build.json"), "w") as f:
                json.dump({"key": key.name, **key.fields}, f, indent=1)
            os.rename(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # gone after the rename; a failed build's leftovers
        seconds = time.perf_counter() - started
        say(f"built in {seconds:.0f} s")
        return CachedBuild(os.path.join(final, LIBRARY), built=True, seconds=seconds)


def describe(key: BuildKey) -> str:
    """``torch 2.13.0+cpu (CPU)`` or ``torch 2.11.0+cu130 (CUDA 13.0, GPU arch 9.0)``: what a build is for."""
    f = key.fields
    target = f"CUDA {f['cuda']}, GPU arch {f['cuda_arch']}" if f["with_cuda"] else "CPU"
    return f"torch {f['torch']} ({target})"


# Run in a fresh interpreter: torch's builder imports the module it built, which must not happen twice
# in the caller, and a crash of the compiler or of the module's initialisation stays out of it.
_COMPILE_SCRIPT = """
import json, sys
from torch.utils.cpp_extension import load
o = json.loads(sys.argv[1])
flags = ["-DWITH_CUDA"] if o["with_cuda"] else []
load(name="_C", sources=o["sources"], extra_cflags=o["cxx"] + flags, extra_cuda_cflags=o["nvcc"] + flags,
     extra_ldflags=[f"-L{d}" for d in o["library_dirs"]] + [f"-l{lib}" for lib in o["libraries"]] + o["extra_link_args"],
     extra_include_paths=o["include_dirs"], build_directory=sys.argv[2], with_cuda=o["with_cuda"], verbose=True)
"""


def compile_extension(root: str, key: BuildKey, folder: str) -> None:
    """Compiles the sources in ``root`` into ``folder``/``_C.so`` with torch's builder (ninja), in a child
    interpreter that also imports the result once; raises :class:`BuildError` naming the log."""
    options = build_options(root, key.fields["with_cuda"])
    objects = [os.path.splitext(os.path.basename(s))[0] + (".cuda" if s.endswith(".cu") else "") for s in options.sources]
    if len(set(objects)) != len(objects):
        raise BuildError(f"two sources in {root} compile to one object name (torch's builder names objects by "
                         f"file name): {sorted(o for o in objects if objects.count(o) > 1)}")
    env = dict(os.environ)
    bin_dirs = [os.path.dirname(sys.executable)]  # ninja from this environment, also when it is not activated
    with contextlib.suppress(ImportError):
        import ninja

        bin_dirs.append(ninja.BIN_DIR)
    env["PATH"] = os.pathsep.join(bin_dirs + [env.get("PATH", "")])
    if key.fields["with_cuda"] and key.fields["cuda_arch"] != "auto":
        env["TORCH_CUDA_ARCH_LIST"] = key.fields["cuda_arch"]
    env.setdefault("MAX_JOBS", str(len(os.sched_getaffinity(0))))
    log_path = os.path.join(folder, "build.log")
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(options.__dict__), folder],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0 or not os.path.isfile(os.path.join(folder, LIBRARY)):
        kept = os.path.join(os.path.dirname(folder), f"{key.name}.failed.log")
        shutil.copyfile(log_path, kept)
        with open(log_path, errors="replace") as f:
            tail = " | ".join(line.strip() for line in f.read().splitlines()[-6:] if line.strip())
        raise BuildError(f"building the compiled kernels failed (exit {done.returncode}; log {kept}): {tail}")


def build_here(root: str, key: BuildKey, force: bool = False) -> CachedBuild:
    """The cached build for ``key`` from the sources in ``root``, compiled now if needed (:func:`ensure_build`);
    :class:`BuildError` when no compiler is found or the build fails."""
    problem = compiler_problem()
    if problem:
        raise BuildError(problem)
    return ensure_build(key, lambda folder: compile_extension(root, key, folder), force=force)
