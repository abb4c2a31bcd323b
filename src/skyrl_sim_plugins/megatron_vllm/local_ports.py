"""A free TCP port on this machine's loopback, for the servers and rendezvous the real backend starts.

The OS picks the port, so two runs on one machine (two test runs, a probe beside a run) never ask for the same fixed
number. The port is free when picked; its user binds it right after, and nothing reserves it in between."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
