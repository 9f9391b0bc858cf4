"""A guard that keeps an instance answering when its admission loop stops awaiting.

The admission loop shares its event loop with the instance's HTTP server (state polls,
aborts, new calls). Every turn normally awaits something that suspends (an engine step, a
wait for a change), so the server gets its turns. A decision that reopens the same state
without awaiting (as the priority switch once did, closing and reopening a slot at one
instant) spins the loop, and the instance then answers nothing until it is killed. The
guard notices turns taken without the event loop running anything else in between (a
probe scheduled with ``call_soon`` has not run) and, past ``max_turns`` of them, has the
loop yield once: a spin then costs CPU and a warning, not the instance. Normal turns never
reach the limit, so the simulated replay is unchanged (the probe only sets a flag).
"""

from __future__ import annotations

import asyncio

__all__ = ["MAX_TURNS_WITHOUT_YIELD", "YieldGuard"]

MAX_TURNS_WITHOUT_YIELD = 1000  # a normal turn suspends; a run this long is a spin


class YieldGuard:
    def __init__(self, max_turns: int = MAX_TURNS_WITHOUT_YIELD) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self._pending = False  # a probe waits for the event loop
        self._turns = 0  # turns since the event loop last ran the probe

    def must_yield(self) -> bool:
        """Called once a turn: True when the last ``max_turns`` turns ran without the event
        loop getting a turn (then the caller yields, and the count starts again)."""
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._ran)
            return False
        self._turns += 1
        return self._turns >= self.max_turns

    def _ran(self) -> None:
        self._pending = False
        self._turns = 0
