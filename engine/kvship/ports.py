"""A loopback TCP port free now, for a process about to bind it: a tensor-parallel group's
rendezvous, the router's relay, and the servers that tests and benches start."""
from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range. A port bound to 0 comes from
    that range, from which every outgoing connection also takes its source port, so such a port
    could be taken (by any client's connection) before the process it is meant for binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()  # whatever a caller seeded, each process draws its own ports
    for _ in range(100):
        port = pick.randrange(max(1024, low - 16384), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")
