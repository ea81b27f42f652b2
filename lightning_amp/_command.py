"""Whether this process is the ``lightning-amp`` command, whose ``import lightning_amp`` imports nothing more.

``import lightning_amp`` imports the whole package (torch, Lightning, the compiled core) and registers
``strategy="tp_fused"`` with Lightning; the command's argument parsing and ``--help`` need none of it, and
taking it cost 5.5 s. So in the command the package's public names import on first use
(``lightning_amp/__init__.py``). Imports nothing of lightning-amp, torch or Lightning.
"""
import os
import sys

COMMAND = "lightning-amp"  # the console script
COMMAND_MODULE = "lightning_amp.cli"  # python -m lightning_amp.cli
_OPTIONS_WITH_A_VALUE = ("-X", "-W", "--check-hash-based-pycs")


def started_as_command() -> bool:
    """Whether the interpreter was started as the ``lightning-amp`` console script or as ``python -m
    lightning_amp.cli``. Read from ``sys.orig_argv``, the command line the process was started with, which
    multiprocessing's spawn does not rewrite (it rewrites ``sys.argv``): the benchmark's worker processes import
    the package in full."""
    args = iter(getattr(sys, "orig_argv", [])[1:])
    for arg in args:
        if arg in _OPTIONS_WITH_A_VALUE:
            next(args, None)
        elif arg == "-m" or arg.startswith("-m"):
            return (arg[2:] or next(args, None)) == COMMAND_MODULE
        elif arg.startswith("-c") or arg == "-":
            return False
        elif not arg.startswith("-"):
            return os.path.basename(arg) == COMMAND
    return False
