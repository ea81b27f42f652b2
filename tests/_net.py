"""Helpers shared by the multi-process tests (gloo on loopback)."""
import os
import random
import socket
import subprocess
import time


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
