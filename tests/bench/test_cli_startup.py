"""``lightning-amp`` starts without torch (issue 41): ``--help`` and bad input answer without importing torch or
Lightning (5.5 s before, 0.1 s after), bad input exits 2 with the allowed values and no traceback; ``bench --dtype``
takes the names the plugins take, from their one table."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_amp import _command, cli
from lightning_amp._dtype_names import HALF_DTYPE_NAMES
from lightning_amp.amp.levels import resolve_dtype

ROOT = Path(__file__).resolve().parents[2]


def _commands():
    """The command as a user starts it: ``python -m lightning_amp.cli``, and the console script where installed."""
    yield [sys.executable, "-X", "importtime", "-m", "lightning_amp.cli"]
    script = Path(sys.executable).with_name("lightning-amp")
    if script.exists():
        yield [sys.executable, "-X", "importtime", str(script)]


@pytest.mark.parametrize("command", list(_commands()), ids=["module", "console-script"][:len(list(_commands()))])
@pytest.mark.parametrize("argv, status, says", [
    (["--help"], 0, "usage: lightning-amp"), (["bench", "--help"], 0, "--dtype DTYPE"), (["--version"], 0, "lightning-amp "),
    (["bench", "--dtype", "fp8"], 2, "unknown dtype 'fp8'; choose from auto, float16 (fp16/half), bfloat16 (bf16)"),
    (["bench", "--levels", "O7"], 2, "unknown level O7; choose from"),
])
def test_help_and_bad_input_import_no_torch_and_show_no_traceback(command, argv, status, says):
    result = subprocess.run(command + argv, capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == status, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "lightning_amp" in imported and not imported & {"torch", "lightning", "numpy"}, sorted(imported)
    output = result.stdout + "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import time:"))
    assert says in output and "Traceback" not in output


@pytest.mark.parametrize("orig_argv, expected", [
    (["python", "/venv/bin/lightning-amp", "bench", "--quick"], True),
    (["python", "-X", "importtime", "-m", "lightning_amp.cli", "--help"], True),
    (["python", "-mlightning_amp.cli"], True),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"], False),
    (["python", "-m", "lightning_amp.bench", "--model", "bert"], False),  # a benchmark run: the package in full
    (["python", "train.py", "lightning-amp"], False), (["python", "-m", "pytest"], False), (["python"], False),
])
def test_only_the_command_imports_the_package_lazily(orig_argv, expected, monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert _command.started_as_command() is expected


@pytest.mark.parametrize("name", [*HALF_DTYPE_NAMES, "FP16", " Bf16 ", "auto"])
def test_bench_dtype_takes_every_name_the_plugins_take(name):
    dtype = cli.build_parser().parse_args(["bench", "--dtype", name]).dtype
    assert dtype in ("auto", "float16", "bfloat16")
    assert resolve_dtype(name, "cuda" if dtype == "auto" else "cpu") == resolve_dtype(dtype, "cuda")
    if dtype != "auto":
        assert getattr(torch, dtype) == resolve_dtype(name)



def test_the_command_imports_the_rest_when_it_runs():
    """In the command the package's names import on first use: ``info`` (torch, the compiled core) and the public
    names read through the package (``lightning_amp.AmpO2Precision``, ``from lightning_amp import *``) work there."""
    result = subprocess.run([sys.executable, "-m", "lightning_amp.cli", "info"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "compiled extension:" in result.stdout, result.stderr[-2000:]
    probe = ("import sys; sys.orig_argv = ['python', '-m', 'lightning_amp.cli']; import lightning_amp; "
             "assert 'torch' not in sys.modules; print(lightning_amp.AmpO2Precision.__name__); "
             "from lightning_amp import *; print(LadderRules.__name__)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.split() == ["AmpO2Precision", "LadderRules"], result.stderr[-2000:]
