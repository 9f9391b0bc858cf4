"""Which listening addresses of a serve config would take the same port, and the URL that
reaches a server listening on one.

A wildcard host takes its port on every address of its family (``0.0.0.0``: IPv4, ``::``:
IPv6, as asyncio binds it, IPv6-only; ``""``: both), and ``localhost`` on both loopbacks, so
a router on ``0.0.0.0:9100`` and an instance on ``127.0.0.1:9100`` cannot both listen. Host
names other than ``localhost`` are compared as written (the config is not resolved).
"""

from __future__ import annotations

import socket

__all__ = ["hosts_overlap", "http_url", "socket_family"]

_WILDCARDS = {"": {4, 6}, "0.0.0.0": {4}, "::": {6}}
_LOCALHOST = {"localhost": {4, 6}, "127.0.0.1": {4}, "::1": {6}}
_WILDCARD_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def hosts_overlap(a: str, b: str) -> bool:
    """Whether listening on ``a`` and on ``b`` at one port would collide."""
    if a == b:
        return True
    for wild, other in ((a, b), (b, a)):
        if wild in _WILDCARDS and _WILDCARDS[wild] & _families(other):
            return True
    return "localhost" in (a, b) and a in _LOCALHOST and b in _LOCALHOST


def _families(host: str) -> set[int]:
    if host in _WILDCARDS:
        return _WILDCARDS[host]
    if host in _LOCALHOST:
        return _LOCALHOST[host]
    return {6} if ":" in host else {4}


def http_url(host: str, port: int) -> str:
    """The URL of a server listening at ``host:port``: a wildcard host reached at its
    loopback, an IPv6 address in brackets."""
    host = _WILDCARD_LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def socket_family(host: str) -> socket.AddressFamily:
    """The family of a socket that binds ``host`` (IPv4 unless it is an IPv6 address)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET
