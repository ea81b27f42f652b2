"""Builds the compiled core ``lightning_amp._C`` from ``csrc/``.

CPU kernels are always built. CUDA kernels are added when the installed torch has CUDA and
``nvcc`` is found (``CUDA_HOME``); ``LIGHTNING_AMP_NO_EXT=1`` skips the extension entirely
(the package then runs on its pure-PyTorch fallbacks).
"""
import glob
import os

from setuptools import setup


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
    cxx = ["-O3", "-std=c++17", "-fopenmp"]
    include_dirs = [os.path.join(here, "csrc")]
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "lightning_amp._C",
            sources + cuda_sources,
            include_dirs=include_dirs,
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math", "-std=c++17"]},
            libraries=["cublas", "cublasLt"],
        )
    else:
        ext = cpp_extension.CppExtension("lightning_amp._C", sources, include_dirs=include_dirs, extra_compile_args=cxx)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
