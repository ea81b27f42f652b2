"""``make gpu-check``'s build: ``setup.py build_ext --inplace`` with every source compiled in parallel.

    MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 python -m gpu_check.build   # in the repository root

It imports nothing of ``lightning_amp`` (nor does ``gpu_check/__init__.py``): importing that package
would load the ``lightning_amp._C`` this rebuilds in place. torch's ``BuildExtension`` reads
``TORCH_CUDA_ARCH_LIST`` (the architectures to compile for) and, with ninja, ``MAX_JOBS`` (parallel
compiler processes). Without ninja it falls back to setuptools, which compiles one source after another;
then :func:`compile_in_parallel` makes setuptools compile up to ``MAX_JOBS`` sources at once, each in a
forked process (torch's per-source compile swaps the compiler executable on the shared compiler object,
so threads would race). Prints ``build: ninja yes|no, N jobs`` first.
"""
from __future__ import annotations

import os
import runpy
import shutil
import sys
import traceback


def compile_in_parallel(jobs: int) -> bool:
    """Make setuptools' ``CCompiler.compile`` compile up to ``jobs`` sources at once (forked processes);
    False (and nothing changed) where this setuptools has no such compiler class."""
    try:
        from setuptools._distutils import ccompiler
        from setuptools._distutils.errors import CompileError
    except ImportError:
        return False
    if not hasattr(ccompiler.CCompiler, "_setup_compile"):
        return False

    def compile(self, sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)
        pending, running, failed = [obj for obj in objects if obj in build], {}, []
        while pending or running:
            while pending and len(running) < jobs:
                obj = pending.pop(0)
                pid = os.fork()
                if pid == 0:  # the child compiles one source and exits
                    code = 1
                    try:
                        src, ext = build[obj]
                        self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
                        code = 0
                    except BaseException:  # noqa: BLE001 - reported, then the exit status says it
                        traceback.print_exc()
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                running[pid] = obj
            pid, status = os.wait()
            if status != 0:
                failed.append(running[pid])
            del running[pid]
        if failed:
            raise CompileError(f"compiling {', '.join(map(os.path.basename, failed))} failed")
        return objects

    ccompiler.CCompiler.compile = compile
    return True


def ninja_available() -> bool:
    """What torch checks before it builds with ninja: ``ninja --version`` runs."""
    return shutil.which("ninja") is not None


def main() -> int:
    jobs = max(1, int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1))
    ninja = ninja_available()
    print(f"build: ninja {'yes' if ninja else 'no'}, {jobs} jobs, TORCH_CUDA_ARCH_LIST="
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(torch default)')}", flush=True)
    if not ninja and not compile_in_parallel(jobs):
        print("build: this setuptools cannot compile in parallel: one source at a time", flush=True)
    sys.argv = ["setup.py", "build_ext", "--inplace"]
    runpy.run_path("setup.py", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
