"""The virtual-time loop: time jumps to the next timer; order and exactness are kept."""

from __future__ import annotations

import asyncio
import threading

import pytest

from talaria.clock import VirtualTimeLoop, new_live_loop, run_live, run_virtual


@pytest.mark.timeout(20)
def test_long_sleeps_finish_without_waiting() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3600)
        after_hour = loop.time()
        await asyncio.sleep(365 * 24 * 3600.0)  # a year: only a jumping clock gets through
        return after_hour - start, loop.time() - after_hour

    hour, year = run_virtual(main())
    assert hour == 3600.0
    assert year == 365 * 24 * 3600.0


def test_start_time_and_loop_type() -> None:
    async def main() -> tuple[float, str]:
        loop = asyncio.get_running_loop()
        return loop.time(), type(loop).__name__

    now, kind = run_virtual(main(), start=1000.0)
    assert now == 1000.0
    assert kind == VirtualTimeLoop.__name__


def test_timer_order_is_preserved() -> None:
    async def main() -> list[tuple[float, str]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[float, str]] = []

        async def sleeper(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            seen.append((loop.time(), name))

        loop.call_later(2.5, lambda: seen.append((loop.time(), "timer-2.5-first")))
        loop.call_later(2.5, lambda: seen.append((loop.time(), "timer-2.5-second")))
        loop.call_at(0.75, lambda: seen.append((loop.time(), "at-0.75")))
        await asyncio.gather(sleeper("s3", 3.0), sleeper("s1", 1.0), sleeper("s0", 0.0))
        return seen

    seen = run_virtual(main())
    assert seen == [
        (0.0, "s0"),
        (0.75, "at-0.75"),
        (1.0, "s1"),
        (2.5, "timer-2.5-first"),
        (2.5, "timer-2.5-second"),
        (3.0, "s3"),
    ]


def test_ready_work_runs_before_time_moves() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        times: list[float] = []

        async def spinner() -> None:
            for _ in range(100):
                times.append(loop.time())
                await asyncio.sleep(0)

        timer = asyncio.ensure_future(asyncio.sleep(5.0))
        await spinner()
        await timer
        times.append(loop.time())
        return times

    times = run_virtual(main())
    assert times[:100] == [0.0] * 100
    assert times[-1] == 5.0


def test_wakeup_from_another_thread_when_nothing_is_scheduled() -> None:
    async def main() -> str:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(fut.set_result, "hi")).start()
        return await fut

    assert run_virtual(main()) == "hi"


def test_wait_for_timeouts_use_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=42.0)
        return loop.time()

    assert run_virtual(main()) == 42.0


def test_live_loop_runs() -> None:
    async def main() -> float:
        await asyncio.sleep(0)
        return asyncio.get_running_loop().time()

    assert run_live(main()) > 0
    loop = new_live_loop()
    try:
        assert not isinstance(loop, VirtualTimeLoop)
    finally:
        loop.close()
