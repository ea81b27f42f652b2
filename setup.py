"""Builds the compiled core ``lightning_amp._C`` from ``csrc/``.

CPU kernels are always built. CUDA kernels are added when the installed torch has CUDA and
``nvcc`` is found (``CUDA_HOME``), unless ``LIGHTNING_AMP_CPU_ONLY=1`` (the CPU kernels only, e.g. to test
the CPU side against a CUDA build of torch on a machine without a GPU); ``LIGHTNING_AMP_NO_EXT=1`` skips
the extension entirely (the package then runs on its pure-PyTorch fallbacks).

The CPU kernels use ATen's ``at::vec::Vectorized``. The package is built from source on the
machine that runs it, so by default they are compiled for the widest vector ISA the build
machine offers (AVX-512 or AVX2, as ATen's own per-capability kernels are);
``LIGHTNING_AMP_PORTABLE=1`` builds baseline x86-64 code instead (for a wheel meant to be
copied to other machines).

``LIGHTNING_AMP_OPT`` sets the optimisation flag (default ``-O3``); the CI ABI check, which only
loads the library, builds with ``-O0`` to save time (unoptimised code references at least the
torch symbols that optimised code does).

cuBLAS headers and library come from the CUDA toolkit when it has them; a toolkit that ships
only nvcc (e.g. a CI machine without a GPU) is completed by the ``nvidia-*`` wheels that the CUDA
build of torch installed (``site-packages/nvidia/cu13`` or ``nvidia/cublas``). Those headers are
searched after the toolkit's (``-idirafter``), so the toolkit always wins where it has a header.
"""
import glob
import importlib.util
import os

import platform

from setuptools import setup


def _cpu_vector_flags():
    """Compiler flags selecting ATen's vector implementation for the build machine's CPU."""
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


def _nvidia_wheel_cublas(cuda_home):
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


def _extensions():
    if os.environ.get("LIGHTNING_AMP_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils import cpp_extension

    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    if not sources:
        return [], {}
    with_cuda = (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and bool(cuda_sources)
                 and os.environ.get("LIGHTNING_AMP_CPU_ONLY") != "1")
    opt = os.environ.get("LIGHTNING_AMP_OPT", "-O3")
    cxx = [opt, "-std=c++17", "-fopenmp"] + _cpu_vector_flags()
    include_dirs = [os.path.join(here, "csrc")]
    if with_cuda:
        # No --use_fast_math: the inf/nan checks of the multi-tensor kernels must see inf and nan.
        nvcc = [opt, "-std=c++17"]
        link = {"libraries": ["cublas"]}
        wheel = _nvidia_wheel_cublas(cpp_extension.CUDA_HOME)
        if wheel is not None:
            inc, lib, soname = wheel
            cxx = cxx + ["-idirafter", inc]
            nvcc = nvcc + ["-Xcompiler", f"-idirafter{inc}"]
            link = {"library_dirs": [lib], "extra_link_args": [f"-l:{soname}"]}
        ext = cpp_extension.CUDAExtension(
            "lightning_amp._C",
            sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            **link,
        )
    else:
        ext = cpp_extension.CppExtension("lightning_amp._C", sources, include_dirs=include_dirs, extra_compile_args=cxx)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
