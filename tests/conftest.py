"""Shared fixtures.

``flag_timing``: runs a test twice, with each optimizer step's overflow flag reaching the host at
once (``"immediate"``, what the CPU does) and with a device running behind the host (``"late"``:
a flag lands only when waited for or ``LATE_STEPS`` steps later, through
``LIGHTNING_AMP_SIMULATE_DEVICE_LAG``, see :mod:`lightning_amp.amp.gate`). The variable is in the
environment, so processes a test spawns (DDP ranks) run late too. On CUDA the flags of real
device steps land late anyway; the simulation only holds them back further.

The tests are laid out like the package (``tests/amp/``, ``tests/parallel/``, ...); what they share is the package
``tests/support/``, and this folder goes on ``sys.path`` so any test module, in any subfolder, imports it as
``from support.processes import free_port`` however pytest was started (from the root, a subfolder, one file,
``--import-mode=importlib``). The repository root goes at the end of ``sys.path`` for the same reason: the
``make gpu-check`` tooling that tests/bench/ tests is the package ``gpu_check/`` there, outside the installed
package (``python -m pytest`` in the root finds it anyway; at the end, it never shadows an installed lightning_amp).
"""
import getpass
import os
import sys
import tempfile

import pytest
import torch

from lightning_amp.amp.gate import LAG_ENV

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_ROOT = os.path.dirname(_HERE)
if os.path.isdir(os.path.join(_ROOT, "gpu_check")) and _ROOT not in sys.path:
    sys.path.append(_ROOT)

from support.flag_timing import LATE_STEPS  # noqa: E402  (needs _HERE on sys.path)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test starts from the environment the session started with: a Trainer run in this process leaves
    Lightning's ``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT``/``PL_GLOBAL_SEED`` in ``os.environ``, and a
    process started later with that environment (a 2-rank docs block) would take itself for an already
    launched rank and wait for a peer that never comes. Tests then pass in any order."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _one_thread():
    """Each test runs with one intra-op thread and leaves torch's count as it found it. The models are tiny, and on
    2 shared cores a second OpenMP thread spinning at each op's barrier made small-op tests up to 120x slower (the
    fast lane, benchmarks/RESULTS.md). Before, a test ran with the count an earlier test had left in this process (the
    bench CLI's ``--threads 1``): 2 threads in tests/amp/, 1 after tests/bench/test_cli.py, or 2 again in a lane
    without that test. tests/ops/test_ops_multi_tensor.py runs the compiled kernels on 2 threads on purpose."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["immediate", "late"])
def flag_timing(request, monkeypatch):
    monkeypatch.setenv(LAG_ENV, "0" if request.param == "immediate" else str(LATE_STEPS))
    return request.param


def pytest_addoption(parser):
    parser.addoption("--called-modules", metavar="FILE",
                     help="write to FILE which lightning_amp modules had a function called by the tests that ran "
                          "(tests/support/called_modules.py)")


def pytest_configure(config):
    """``--called-modules=FILE``: :class:`support.called_modules.CalledModules` records the run.

    ``ATEN_CPU_CAPABILITY=default`` (a plain x86-64 CPU, emulated: the suite runs so in benchmarks/RESULTS.md)
    caps ATen's kernels but not inductor's code generation, which still reads the host's vector ISA and emits
    ``at::vec`` code that the capped headers do not declare (a C++ compile error). On a CPU that has no vector
    ISA inductor generates scalar loops; ``cpp.simdlen = 1`` makes it do so under the emulation too.

    Inductor's code for one ``ATEN_CPU_CAPABILITY`` must not be served to another: torch's FX graph cache
    key leaves the capability out (torch 2.13), so a graph generated for 8-lane vectors under ``avx2`` was
    reused by the uncapped run (16 lanes: stores past the buffers, glibc aborts with "malloc(): unaligned
    tcache chunk") and the 16-lane one under ``avx2`` (a training loss of inf: RESULTS.md, "Issue 49, session
    2"). Each capability, and the host's own ISA, gets its own inductor cache directory unless the user
    chose one (importing torch sets ``TORCHINDUCTOR_CACHE_DIR`` to its default, shared, directory)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() or "native"
    shared = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, shared):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{shared}_lightning_amp_tests_{capability}"
    if capability == "default":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.simdlen = 1
    if config.getoption("called_modules"):
        from support.called_modules import CalledModules

        config.pluginmanager.register(CalledModules(config.getoption("called_modules")), "called-modules")
