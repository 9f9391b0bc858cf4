"""`talaria serve`'s supervision of its instance processes: one that dies is started again.

A process that exits while serving (killed, crashed, or its admission loop gave up) is
restarted on the same port after a delay that doubles each time it dies young (within
``healthy_after_s`` of its start) and starts over once it has lived that long. When the new
process is ready, ``INSTANCE <id> <pid> <url>`` is printed again on stdout; the router's
health poller finds it answering and places calls on it again (its KV is gone, so its
sessions are rebuilt wherever they go next).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import structlog

log = structlog.get_logger("talaria.serving.supervisor")

__all__ = ["RestartPolicy", "Supervised", "Supervisor"]


class Supervised(Protocol):
    """What the supervisor needs of an instance process."""

    id: str
    ready_file: Path
    url: str | None

    @property
    def pid(self) -> int: ...

    def exit_code(self) -> int | None:
        """None while running."""
        ...


S = TypeVar("S", bound=Supervised)


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    healthy_after_s: float = 60.0  # a process that lived this long starts the backoff over
    poll_s: float = 0.2

    def delay(self, young_deaths: int) -> float:
        # The exponent is capped: 2 ** 1024 is beyond a float, and a process that crash-loops
        # for hours must not end the supervisor with an OverflowError.
        doublings = min(max(0, young_deaths - 1), 64)
        return min(self.max_delay_s, self.first_delay_s * 2**doublings)


class Supervisor(Generic[S]):
    """Watches ``children`` (replacing a restarted process in the list in place, so whoever
    stops the list at shut-down stops the live processes)."""

    def __init__(
        self,
        children: list[S],
        spawn: Callable[[str], S],
        policy: RestartPolicy | None = None,
        restartable: set[str] | None = None,
    ) -> None:
        """``restartable``: the instances to start again (None: all); the others are
        only reported when they exit."""
        self.children = children
        self.spawn = spawn
        self.restartable = {c.id for c in children} if restartable is None else restartable
        self.policy = policy or RestartPolicy()
        self.restarts: dict[str, int] = {c.id: 0 for c in children}
        self._young_deaths: dict[str, int] = {c.id: 0 for c in children}
        self._started: dict[str, float] = {}
        self._due: dict[str, float] = {}  # instance id -> loop time of its restart
        self._announce: set[str] = set()  # restarted, INSTANCE line not printed yet
        self._gone: set[str] = set()  # exited, not to be restarted

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        for child in self.children:
            self._started.setdefault(child.id, loop.time())
        while not stop.is_set():
            self.check(loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.policy.poll_s)

    def check(self, now: float) -> None:
        """One look at every child: schedule restarts, start due ones, announce ready ones."""
        for i, child in enumerate(self.children):
            code = child.exit_code()
            if child.id in self._due:
                if now >= self._due[child.id]:
                    self._restart(i, child, now)
            elif code is not None and child.id not in self._gone:
                self._schedule(child, code, now)
            elif child.id in self._announce and child.ready_file.is_file():
                self._announce.discard(child.id)
                print(f"INSTANCE {child.id} {child.pid} {child.url}", flush=True)
                log.info("supervisor.instance_restarted", instance=child.id, pid=child.pid)

    def _restart(self, i: int, child: S, now: float) -> None:
        """Start the instance again; a start that fails (no file descriptors or memory left,
        a missing interpreter) is retried after the next backoff, like a young death."""
        del self._due[child.id]
        try:
            self.children[i] = self.spawn(child.id)
        except Exception as exc:
            self._young_deaths[child.id] += 1
            delay = self.policy.delay(self._young_deaths[child.id])
            self._due[child.id] = now + delay
            log.exception("supervisor.restart_failed", instance=child.id, retry_in_s=delay)
            print(f"talaria serve: instance {child.id} could not be started ({exc}); trying "
                  f"again in {delay:g} s", file=sys.stderr, flush=True)
            return
        self._started[child.id] = now
        self.restarts[child.id] += 1
        self._announce.add(child.id)

    def _schedule(self, child: S, code: int, now: float) -> None:
        lived = now - self._started.get(child.id, now)
        if child.id not in self.restartable:
            self._gone.add(child.id)
            log.warning("supervisor.instance_exited", instance=child.id, code=code, restart=False)
            return
        young = self._young_deaths[child.id] + 1 if lived < self.policy.healthy_after_s else 1
        self._young_deaths[child.id] = young
        delay = self.policy.delay(young)
        self._due[child.id] = now + delay
        self._announce.discard(child.id)
        log.warning("supervisor.instance_exited", instance=child.id, code=code,
                    lived_s=round(lived, 2), restart_in_s=delay)
        print(f"talaria serve: instance {child.id} exited with code {code}; restarting it "
              f"in {delay:g} s", file=sys.stderr, flush=True)
