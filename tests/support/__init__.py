"""What the tests share, and nothing else: no module here is a test, and none imports a test module.

Tests import from here only (``from support.bounds import gamma``): never from another test module, a
``conftest``, or a loose module beside them (tests/test_suite_layout.py checks). ``tests/`` is on ``sys.path``
however pytest is started (``tests/conftest.py`` puts it there); a child process gets it on ``PYTHONPATH``
(:func:`support.processes.child_env`).

* :mod:`support.bounds`: rounding-error bounds that tolerances come from.
* :mod:`support.flag_timing`: the ``"late"`` overflow-flag timing's lag (the ``flag_timing`` fixture).
* :mod:`support.trainer`: quiet Lightning, a loss-recording callback.
* :mod:`support.ladder_nets`: models that fail on the float16 ladder's upper rungs, and their Trainer run.
* :mod:`support.after_fit_model`: a LightningModule that unpickles without lightning_amp.
* :mod:`support.optional_deps`: optional test dependencies, skipped where absent and required in CI.
* :mod:`support.processes`: ports, ranks, and the child processes the tests start.
* :mod:`support.fresh_ops`: an independent copy of ``lightning_amp.ops`` executed under a test's patches.
* :mod:`support.dtensor_checks`: the multi-tensor operators' checks on DTensors.
* :mod:`support.torchtitan_llama`, :mod:`support.renamed`, :mod:`support.simulated_ranks`: models written as
  others write them, the same with their attributes renamed, and tensor-parallel ranks simulated in one process.
* :mod:`support.scripts`: what a child process runs as its main module.

This ``__init__`` imports nothing: a process that must not import lightning_amp imports
:mod:`support.after_fit_model` through it.
"""
