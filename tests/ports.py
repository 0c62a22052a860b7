"""Ports for the few third-party servers that cannot bind port 0 and say which port they got (redis-server,
`vllm serve`, torchrun's rendezvous store). Every meshrl server binds port 0 and announces its port instead
(`meshrl <role> listening on host:port`): tests read that line and never pick a port for it.

A port is never probed (bound, closed, then handed to a server: another process may take it in between). It is
drawn at random below the kernel's ephemeral range, where port-0 binds and outgoing connections never land, and
the server is started on it; only a real `Address already in use` from that server draws another, a bounded
number of times."""

from __future__ import annotations

import random
from typing import Callable, TypeVar

T = TypeVar("T")

# Linux hands out ephemeral ports from 32768 up (net.ipv4.ip_local_port_range's default): these are below it.
LOW, HIGH = 20000, 32000
IN_USE = ("Address already in use", "EADDRINUSE", "address already in use")
ATTEMPTS = 8


class PortInUse(Exception):
    """The server failed to bind its port because something else holds it."""


def in_use(text: str) -> bool:
    """Whether a server's output says its bind failed on a port in use."""
    return any(marker in text for marker in IN_USE)


def pick() -> int:
    return random.SystemRandom().randrange(LOW, HIGH)


def start_on_a_port(start: Callable[[int], T], *, port: int | None = None, attempts: int = ATTEMPTS) -> T:
    """start(port) until it does not raise PortInUse: a fresh random port each time, or always `port` when given
    (a server restarted where its clients look for it; the old socket may linger a moment)."""
    tried = []
    for _ in range(attempts):
        tried.append(port if port is not None else pick())
        try:
            return start(tried[-1])
        except PortInUse:
            continue
    raise AssertionError(f"every port tried was in use: {tried}")
