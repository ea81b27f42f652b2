"""Networking helpers shared by the multi-process tests (gloo on loopback)."""
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
