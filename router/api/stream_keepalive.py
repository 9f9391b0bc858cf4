"""Keep-alives once a streamed answer has begun: a stream never stays silent longer than about
``stream_keepalive_s`` while its call's events keep coming.

Before its first event a committed stream sends its API's keep-alive every
``stream_keepalive_s`` (``router.api.stream_commit``). After it, events may still arrive
for minutes and send nothing: text a model writes after a whole tool call with parallel
calls on (dropped, ``router.api.answer_parser``), reasoning a client did not ask to see,
text held back for a possible stop string or tag. An idle timeout (a proxy's, often 60 s;
Codex's, 300 s between the events it parses; the SDKs' read timeouts, 600 s) would cut such
a stream. So every answer's stream is a :class:`WatchedStream`, which notes when it last
wrote (every API writes through ``write``), and ``collect`` (``router.api.stream_output``)
asks its :class:`KeepAlive` after each event that does not end the answer; the keep-alive,
the same one each API sends before its first event, goes out when the stream has been silent
``stream_keepalive_s``. A stream that sends steadily gets none. An instance that sends no
events at all is left to the router's stall deadline (``router.instances.deadlines``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

__all__ = ["KeepAlive", "WatchedStream"]


def _now() -> float:
    return asyncio.get_running_loop().time()


class WatchedStream(web.StreamResponse):
    """A streamed answer's response that counts what it sent (its headers, each write) and
    notes when it last sent anything, on the event loop's clock (None before it began)."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__(headers=headers)
        self.sends = 0
        self.sent_at: float | None = None

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        writer = await super().prepare(request)
        self._sent()
        return writer

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await super().write(data)
        self._sent()

    def _sent(self) -> None:
        self.sends += 1
        self.sent_at = _now()


@dataclass
class KeepAlive:
    """``send`` (the API's keep-alive, written through ``stream``) after an event that sent
    nothing, once ``stream`` has been silent for ``period_s``. Made once the stream has begun
    and asked after each event; an event that wrote needs none, however long its write took."""

    stream: WatchedStream
    send: Callable[[], Awaitable[None]]
    period_s: float
    _seen: int = field(init=False, default=0)  # the stream's ``sends`` at the last ask

    def __post_init__(self) -> None:
        self._seen = self.stream.sends

    async def if_idle(self) -> None:
        sent_at = self.stream.sent_at
        silent = self.stream.sends == self._seen
        if silent and sent_at is not None and _now() - sent_at >= self.period_s:
            await self.send()
        self._seen = self.stream.sends
