"""A TCP port for a server Miles starts (an engine, a torch process group's store, a test's server).

The kernel's own choice (binding port 0) comes from the range it also gives every outgoing connection's local
port: a port found free that way can be taken by some process's next connection (Ray's, an HTTP client's)
before the server binds it, and the server then fails to start. So ports are drawn at random below that range,
above the ports Ray gives its workers (10002-19999), and checked free; one process never hands out the same port
twice in a row of recent picks."""

from __future__ import annotations

import collections
import random
import socket

__all__ = ["free_port"]

_LOW = 20_000  # Ray's worker ports end at 19999
_DEFAULT_EPHEMERAL_LOW = 32_768
_RECENT: collections.deque[int] = collections.deque(maxlen=256)
_RANDOM = random.SystemRandom()  # a test's random.seed(...) must not make every process pick alike


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now, outside the kernel's range for outgoing connections."""
    high = _ephemeral_low()
    if high - _LOW >= 1024:
        for _ in range(200):
            port = _RANDOM.randrange(_LOW, high)
            if port not in _RECENT and _bindable(host, port):
                _RECENT.append(port)
                return port
    with socket.socket() as s:  # a kernel whose outgoing range leaves no room below it: its own choice
        s.bind((host, 0))
        port = s.getsockname()[1]
    _RECENT.append(port)
    return port
