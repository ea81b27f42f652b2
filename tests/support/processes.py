"""The processes the tests start (gloo on loopback): a free ``MASTER_PORT``, the scripts of :mod:`support.scripts`
run as a child's main module, ranks started as torchrun would, a function spawned on 2 ranks."""
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
#: what tells a process it is a rank of a launched job (a parent's must not leak into a job it starts)
RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def _ephemeral_range() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for MASTER_PORT), outside the kernel's ephemeral range.

    Port 0 would hand out an ephemeral port: the range every outgoing connection draws from, gloo's many
    rank-to-rank connections included, so between this call and the rank that binds it the port could be taken
    (more likely on a loaded machine). A random port below that range, checked free, is not handed out by the
    kernel to anyone else."""
    ephemeral = _ephemeral_range()
    candidates = [p for p in range(10000, 65535) if p not in ephemeral]
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port outside the ephemeral range on 127.0.0.1 after 200 tries")


def script(name: str, *args) -> list:
    """The command that runs ``support/scripts/<name>.py`` with ``args`` as a process's main module (``python -m``:
    Lightning's launcher and multiprocessing's spawn start their other processes the same way). Needs
    :func:`child_env`'s ``PYTHONPATH``."""
    return [sys.executable, "-m", f"support.scripts.{name}", *map(str, args)]


def child_env(env: dict = None, **extra: str) -> dict:
    """``env`` (default: this process's environment) updated with ``extra``, with this checkout's package and
    ``tests/`` (where :mod:`support` is) before the inherited ``PYTHONPATH``."""
    env = dict(os.environ if env is None else env, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(TESTS), env.get("PYTHONPATH")]))
    return env


def run_script(name: str, *args, timeout: float = 240) -> None:
    """Runs :func:`script` ``(name, *args)``, one process that starts its ranks itself (none of this process's
    :data:`RANK_VARIABLES`; ``MASTER_ADDR`` loopback, a free ``MASTER_PORT``); fails with its output's tail unless it
    exits 0."""
    env = child_env({k: v for k, v in os.environ.items() if k not in RANK_VARIABLES},
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(script(name, *args), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def run_two_ranks(name: str, *args, timeout: float = 600) -> None:
    """:func:`run_ranks` with 2 ranks."""
    run_ranks(name, args, 2, timeout)


def run_ranks(name: str, args, world_size: int, timeout: float = 600) -> None:
    """Runs :func:`script` ``(name, *args)`` as ranks 0 .. ``world_size`` - 1 of one job, started as torchrun would
    (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` in the environment, so Lightning launches nothing
    itself); fails with the log tail of a rank that does not exit 0."""
    env = child_env({k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "GROUP_RANK")},
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size), NODE_RANK="0")
    procs = [subprocess.Popen(script(name, *args), env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world_size)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]


def run_on_two_ranks(fn, *args) -> None:
    """``fn(rank, *args)`` on 2 spawned processes in one gloo group (1 thread each); fails if either fails."""
    mp.spawn(_entry, args=(fn, free_port(), args), nprocs=2, join=True)


def _entry(rank, fn, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
