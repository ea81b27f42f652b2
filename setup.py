"""Builds the compiled core ``lightning_amp._C`` from ``csrc/``.

CPU kernels are always built. CUDA kernels are added when the installed torch has CUDA and
``nvcc`` is found (``CUDA_HOME``); ``LIGHTNING_AMP_NO_EXT=1`` skips the extension entirely
(the package then runs on its pure-PyTorch fallbacks).

The CPU kernels use ATen's ``at::vec::Vectorized``. The package is built from source on the
machine that runs it, so by default they are compiled for the widest vector ISA the build
machine offers (AVX-512 or AVX2, as ATen's own per-capability kernels are);
``LIGHTNING_AMP_PORTABLE=1`` builds baseline x86-64 code instead (for a wheel meant to be
copied to other machines).
"""
import glob
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
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= words:
        isa = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        return isa + ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= words:
        return ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


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
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and bool(cuda_sources)
    cxx = ["-O3", "-std=c++17", "-fopenmp"] + _cpu_vector_flags()
    include_dirs = [os.path.join(here, "csrc")]
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "lightning_amp._C",
            sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("WITH_CUDA", None)],
            # No --use_fast_math: the inf/nan checks of the multi-tensor kernels must see inf and nan.
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17"]},
            libraries=["cublas", "cublasLt"],
        )
    else:
        ext = cpp_extension.CppExtension("lightning_amp._C", sources, include_dirs=include_dirs, extra_compile_args=cxx)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
