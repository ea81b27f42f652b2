"""Builds the package, and the compiled core ``lightning_amp._C`` when a torch is importable here.

The C++/CUDA sources in ``csrc/`` ship in both distributions: the sdist holds ``csrc/`` (MANIFEST.in)
and the wheel holds a copy as ``lightning_amp/_csrc/`` (``build_py`` below), so the package can build
its kernels for whatever torch it meets. ``build-system.requires`` names no torch, so pip's default
isolated build never downloads one:

* **isolated build** (``pip install lightning-amp``, ``pip install .``, ``python -m build``): torch is
  not importable, no extension is compiled, and the first ``import lightning_amp`` builds it for the
  running torch into a per-user cache (``lightning_amp/ops/_build.py``; ``lightning-amp build`` does it
  ahead);
* **build against the installed torch** (``pip install --no-build-isolation``, ``make install``,
  ``python setup.py build_ext --inplace``): the extension is compiled here, and
  ``lightning_amp/_C.build.json`` records the torch, CUDA version, C++ ABI and Python it was built for;
  the loader uses it only under that torch and otherwise builds into the cache.

The build itself (sources, flags, cuBLAS from the nvidia wheels) is described once, in
``lightning_amp/ops/_build.py``, for both ways. Environment switches:

* ``LIGHTNING_AMP_NO_EXT=1`` compiles nothing even when torch is importable;
* ``LIGHTNING_AMP_CPU_ONLY=1`` builds the CPU kernels only (CUDA kernels are otherwise added when
  torch is a CUDA build and ``nvcc`` is found, ``CUDA_HOME``), e.g. to test the CPU side against a CUDA
  build of torch on a machine without a GPU;
* ``LIGHTNING_AMP_PORTABLE=1`` builds baseline x86-64 code instead of the widest vector ISA of the
  build machine (AVX-512 or AVX2, as ATen's own per-capability kernels are; for a wheel meant to be
  copied to other machines);
* ``LIGHTNING_AMP_OPT`` sets the optimisation flag (default ``-O3``); the CI ABI check, which only loads
  the library, builds with ``-O0`` to save time (unoptimised code references at least the torch
  symbols that optimised code does).

cuBLAS headers and library come from the CUDA toolkit when it has them; a toolkit that ships only
nvcc (e.g. a CI machine without a GPU) is completed by the ``nvidia-*`` wheels that the CUDA build of
torch installed (``site-packages/nvidia/cu13`` or ``nvidia/cublas``), searched after the toolkit's
headers (``-idirafter``), so the toolkit always wins where it has a header.
"""
import importlib.util
import json
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = "csrc"  # relative: setuptools wants relative source paths


def _load_build_module():
    """lightning_amp/ops/_build.py, loaded by path: importing the package would import torch and Lightning."""
    spec = importlib.util.spec_from_file_location("_lightning_amp_build", os.path.join(HERE, "lightning_amp", "ops",
                                                                                          "_build.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


_build = _load_build_module()


class BuildPyWithSources(build_py):
    """Also copies ``csrc/`` into the built package as ``lightning_amp/_csrc/``, what a first-use build compiles."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "lightning_amp", "_csrc")
        shutil.rmtree(target, ignore_errors=True)
        for rel in _build.source_files(SOURCES):
            os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
            shutil.copyfile(os.path.join(SOURCES, rel), os.path.join(target, rel))


def _extensions():
    if os.environ.get("LIGHTNING_AMP_NO_EXT") == "1" or not _build.source_files(SOURCES):
        return [], {}
    try:
        import torch  # noqa: F401
    except ImportError:
        print("setup.py: no torch importable (an isolated build): lightning_amp._C is not compiled now; the first "
              "`import lightning_amp` builds it for the torch it runs with (or run `lightning-amp build`)")
        return [], {}
    from torch.utils import cpp_extension

    options = _build.build_options(SOURCES, _build.wants_cuda(SOURCES))
    sources = options.sources  # relative, as SOURCES is
    include_dirs = [os.path.join(HERE, d) for d in options.include_dirs]
    link = dict(libraries=options.libraries, library_dirs=options.library_dirs,
                extra_link_args=options.extra_link_args)
    if options.with_cuda:
        ext = cpp_extension.CUDAExtension("lightning_amp._C", sources, include_dirs=include_dirs,
                                          define_macros=[("WITH_CUDA", None)],
                                          extra_compile_args={"cxx": options.cxx, "nvcc": options.nvcc}, **link)
    else:
        ext = cpp_extension.CppExtension("lightning_amp._C", sources, include_dirs=include_dirs,
                                         extra_compile_args=options.cxx)

    class BuildExtWithRecord(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        """Writes ``_C.build.json`` beside the built extension: the runtime it was built for, and from which sources."""

        def run(self):
            super().run()
            record = {**_build.runtime_identity(), "with_cuda": options.with_cuda,
                      "sources": _build.sources_digest(SOURCES)}
            with open(os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), _build.BUILD_RECORD), "w") as f:
                json.dump(record, f, indent=1)

    return [ext], {"build_ext": BuildExtWithRecord}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithSources, **cmdclass})
