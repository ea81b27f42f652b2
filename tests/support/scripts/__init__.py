"""What a child process the tests start runs as its main module, ``python -m support.scripts.<name> ARGS``
(:func:`support.processes.script`): one rank of a job started as torchrun would, or one process that starts its
ranks itself (Lightning's launcher and multiprocessing's spawn start the others the same way, with ``-m``). A test
may import one to run the same code in its own process (the one-process reference). Not test modules."""
