"""``make gpu-check``'s tooling: the one command that builds this commit for the GPU present, checks and
measures it there, and reports a verdict per target (docs/benchmarks.md, "On a GPU machine: `make gpu-check`").

Not part of the installed package: it lives at the repository root beside ``lightning_amp/``, outside
``[tool.setuptools.packages.find]``'s ``include = ["lightning_amp*"]``, so no wheel or install carries it
(tests/test_packaging.py checks). It runs from a source checkout with the root on ``PYTHONPATH`` (``make
gpu-check`` puts it there; ``python -m gpu_check`` in the root finds it too):

    python -m gpu_check [--part smoke,bench,...] [--out DIR] [--budget SECONDS]   # gpu_check.check

Modules: :mod:`gpu_check.check` (the parts, the budget, the command), :mod:`gpu_check.build` (the in-place
build), :mod:`gpu_check.smoke` (CUDA correctness), :mod:`gpu_check.headline` (the BERT-base benchmark),
:mod:`gpu_check.targets` (the targets and verdicts), :mod:`gpu_check.report` (the report) and
:mod:`gpu_check.pytest_log` (the pytest plugin recording each test's outcome). This file imports nothing:
``python -m gpu_check.build`` must not load ``lightning_amp`` (its compiled extension is what it rebuilds).
"""
