"""SIGINT / SIGTERM for a server process: the first stops it gracefully, the second hurries.

The first signal sets ``stop``: the server stops taking calls and drains those in flight for
its drain time. A second sets ``hurry``, which the app's drain watches
(``talaria.protocol.drain``): what is still in flight ends at once, each call told the server
is shutting down, as at the drain's timeout. Further signals change nothing more (but in
`talaria serve` waiting for its instances, its loop gone: ``serve._stop_children``); the drain's
own bounds (a few seconds for the calls cut to answer) still hold, so nothing is left
half-written and no child process is orphaned. ``name`` prefixes the line each signal prints
on stderr (an operator pressing Ctrl-C sees what it did).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field

from aiohttp import web

from talaria.protocol.drain import DRAIN_HURRY_KEY

__all__ = ["ShutdownSignals"]


@dataclass
class ShutdownSignals:
    name: str
    drain_s: float
    announce: bool = True
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def install(self) -> ShutdownSignals:
        """Handle SIGINT and SIGTERM on the running loop; returns itself."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.signalled)
        return self

    def attach(self, app: web.Application) -> None:
        """Let ``app``'s drain be hurried by a second signal (before the app starts)."""
        app[DRAIN_HURRY_KEY] = self.hurry

    def signalled(self) -> None:
        if not self.stop.is_set():
            self.stop.set()
            self._say(f"stopping: calls in flight get up to {self.drain_s:g} s to finish "
                      "(signal again to end them now)")
        elif not self.hurry.is_set():
            self.hurry.set()
            self._say("ending the calls still in flight now")

    def _say(self, text: str) -> None:
        if self.announce:
            print(f"{self.name}: {text}", file=sys.stderr, flush=True)
