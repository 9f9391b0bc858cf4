"""Event loops for the two clocks: live (wall time) and virtual (simulated time).

Policy code reads time only from ``asyncio.get_running_loop().time()`` and waits only with
``asyncio.sleep`` / loop timers, so the same code runs under either loop.

Under :class:`VirtualTimeLoop` time does not pass by itself: when no callback is ready and no
I/O is pending, the clock jumps straight to the next scheduled timer. Timer order is the
ordinary asyncio order (by deadline, then by scheduling order). Work handed to threads
(``run_in_executor``) still takes real time and the virtual clock does not wait for it while
timers are pending, so simulated engines are called directly, never through threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["VIRTUAL_CLOCK_RESOLUTION_S", "VirtualTimeLoop", "new_virtual_loop", "new_live_loop",
           "run_virtual", "run_live"]

# Timers of the virtual loop due within this of "now" run together, so a timer may fire up to
# this much early. The wall-clock default (1 ns) is below a float's resolution once virtual
# time reaches ~1e7 s, which would stall.
VIRTUAL_CLOCK_RESOLUTION_S = 1e-6


class _JumpingSelector(selectors.BaseSelector):
    """Wraps a real selector; a positive timeout with no I/O ready advances virtual time."""

    def __init__(self, inner: selectors.BaseSelector) -> None:
        self._inner = inner
        self._loop: VirtualTimeLoop | None = None

    def attach(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout <= 0 or self._loop is None:
            # Nothing scheduled (only I/O or other threads can wake us), or work is ready.
            return self._inner.select(timeout)
        ready = self._inner.select(0)
        if ready:
            return ready
        self._loop._advance(timeout)
        return []

    def close(self) -> None:
        self._inner.close()

    def get_map(self) -> Any:
        return self._inner.get_map()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual and jumps to the next timer."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpingSelector(selectors.DefaultSelector())
        super().__init__(selector)
        selector.attach(self)
        self._virtual_now = float(start)
        self._clock_resolution = VIRTUAL_CLOCK_RESOLUTION_S

    def time(self) -> float:
        return self._virtual_now

    def _advance(self, timeout: float) -> None:
        target = self._virtual_now + timeout
        scheduled = getattr(self, "_scheduled", None)
        if scheduled:
            when = scheduled[0].when()
            # Land exactly on the deadline (no float drift between timeout and deadline).
            if abs(when - target) <= 1e-9 * max(1.0, abs(target)):
                target = when
        self._virtual_now = max(self._virtual_now, target)


def new_virtual_loop(start: float = 0.0) -> VirtualTimeLoop:
    return VirtualTimeLoop(start)


def new_live_loop() -> asyncio.AbstractEventLoop:
    """A wall-clock loop: uvloop when installed, else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# A simulation allocates many small containers per simulated step (events, requests, step
# records), most freed at once by reference counting: the collector's young generation need
# not be scanned every 700 of them (the default), which cost ~8% of a replay. Each scan also
# walks every young prompt list (tens of thousands of ints each): the default trace on 16
# servers spent 8.7 of 100 CPU-s collecting at 10,000, 2.6 of 90 at 100,000 (1.9 at 1M).
_VIRTUAL_GC_THRESHOLD0 = 100_000


@contextlib.contextmanager
def _young_gc_threshold(threshold0: int) -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(max(threshold0, saved[0]), *saved[1:])
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def run_virtual(coro: Coroutine[Any, Any, T], start: float = 0.0, debug: bool = False) -> T:
    """Run ``coro`` to completion under a fresh virtual-time loop (the garbage collector's
    young generation collected less often meanwhile; restored after)."""
    with _young_gc_threshold(_VIRTUAL_GC_THRESHOLD0), asyncio.Runner(
        debug=debug, loop_factory=lambda: VirtualTimeLoop(start)
    ) as runner:
        return runner.run(coro)


def run_live(coro: Coroutine[Any, Any, T], debug: bool = False) -> T:
    """Run ``coro`` to completion under a fresh wall-clock loop (uvloop when available)."""
    with asyncio.Runner(debug=debug, loop_factory=new_live_loop) as runner:
        return runner.run(coro)
