"""Helpers shared by the multi-process tests (gloo on loopback)."""
import os
import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(argv: list, pythonpath: list, timeout: float = 600) -> None:
    """Runs ``argv`` as ranks 0 and 1 of one job: :func:`run_ranks` with 2 ranks."""
    run_ranks(argv, pythonpath, 2, timeout)


def run_ranks(argv: list, pythonpath: list, world_size: int, timeout: float = 600) -> None:
    """Runs ``argv`` as ranks 0 .. ``world_size`` - 1 of one job, started as torchrun would (``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment, so Lightning launches nothing itself), with
    the folders ``pythonpath`` before the inherited ``PYTHONPATH``; fails with the log tail of a rank that does not
    exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "GROUP_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), NODE_RANK="0",
               PYTHONPATH=os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen(argv, env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world_size)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
