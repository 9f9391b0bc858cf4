"""Which listening addresses of a serve config would take the same port.

A wildcard host takes its port on every address of its family (``0.0.0.0``: IPv4, ``::``:
IPv6, as asyncio binds it, IPv6-only; ``""``: both), and ``localhost`` on both loopbacks, so
a router on ``0.0.0.0:9100`` and an instance on ``127.0.0.1:9100`` cannot both listen. Host
names other than ``localhost`` are compared as written (the config is not resolved).
"""

from __future__ import annotations

__all__ = ["hosts_overlap"]

_WILDCARDS = {"": {4, 6}, "0.0.0.0": {4}, "::": {6}}
_LOCALHOST = {"localhost": {4, 6}, "127.0.0.1": {4}, "::1": {6}}


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
