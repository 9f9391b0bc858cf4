"""The router's HTTP client for one instance's internal API.

``POST /internal/v1/calls`` (body: CallRequest JSON) streams NDJSON CallEvent lines;
429 means overloaded (``retry_after_s`` in the body, ``Retry-After`` header); other 4xx
mean the call is invalid; a 503 whose code is ``shutting_down`` that the instance is shutting
down (``InstanceShuttingDown``); a refused connection or a stream whose connection breaks means
the instance is unreachable; 5xx, timeouts and lines that are not a well-formed event mean
it is unavailable.
``POST /internal/v1/calls/{id}/abort``, ``POST /internal/v1/state`` (the sessions changed
since the last poll, merged here into the client's copy: ``talaria.protocol.state_delta``; the
sessions the router let go, ``forget_sessions``, ride along, unless a call used the id again
first, and the reservations to release, unless the instance is older than that list (it
answers 400 to it: the client then stops sending releases there); a large answer, the whole table
of a first poll, is parsed on a worker thread), ``GET /health``. Every request
carries ``Authorization: Bearer <key>`` when the client has the instances' key.

Two connection pools per instance: a call's stream holds its connection for the call's whole
life (queued on the instance included), so call streams, and the aborts of calls, get a pool
without a limit (the instance's own queue and running caps bound the streams, and it answers
429 beyond); the state poll and the health check, which decide whether the instance is up,
get a small pool of their own, so they never wait behind streams or a burst of aborts for a
connection and miss their deadline.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import orjson
import structlog

from router.core import CallRejected
from router.instances.let_go import PendingLetGo
from talaria.protocol import (
    SHUTTING_DOWN,
    CallEvent,
    CallRequest,
    InstanceShuttingDown,
    InstanceState,
    InstanceUnavailable,
    InstanceUnreachable,
    Overloaded,
)
from talaria.protocol.state_delta import MAX_FORGET, SessionsCursor, SessionsDelta, parse_report

MAX_PENDING_FORGET = 1 << 20
LARGE_REPORT_BYTES = 256 * 1024  # about a thousand sessions: parsed on a worker thread

log = structlog.get_logger(__name__)


class _ReleaseRefused(Exception):
    """The instance answered 400 to an ask carrying ``release``: it predates that list."""


class HttpInstanceClient:
    """An :class:`~talaria.protocol.InstanceClient` over aiohttp. Its two ClientSessions (calls
    and aborts; state and health) are created on first use inside the running loop."""

    def __init__(
        self,
        instance_id: str,
        base_url: str,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 10.0,
        key: str | None = None,
        control_connections: int = 4,
        max_event_bytes: int = 16 << 20,
    ) -> None:
        if control_connections < 1:
            raise ValueError(f"control_connections must be >= 1, got {control_connections}")
        if max_event_bytes < 1024:
            raise ValueError(f"max_event_bytes must be >= 1024, got {max_event_bytes}")
        self.instance_id = instance_id
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url.rstrip("/")
        self._streams: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._control_connections = control_connections
        self._max_event_bytes = max_event_bytes
        self._cursor = SessionsCursor()
        self._let_go = PendingLetGo(MAX_PENDING_FORGET)  # what the next polls carry
        self._releases = True  # False once the instance refused an ask with a release ...
        self._refused_epoch: str | None = None  # ... in this process of it (a restart: True)
        self._state_lock: asyncio.Lock | None = None  # one state poll at a time (the cursor)

    def _stream_http(self) -> aiohttp.ClientSession:
        """The pool for call streams and aborts: no connection limit."""
        if self._streams is None or self._streams.closed:
            self._streams = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._streams

    def _control_http(self) -> aiohttp.ClientSession:
        """The pool for state and health: small, and shared with nothing else."""
        if self._control is None or self._control.closed:
            self._control = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._control_connections)
            )
        return self._control

    async def close(self) -> None:
        for session in (self._streams, self._control):
            if session is not None and not session.closed:
                await session.close()

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        url = f"{self.base_url}/internal/v1/calls"
        withdrawn = self._let_go.withdraw(call.session_id)  # a session id in use again is current
        started = False  # its first event came: it ran here
        stream = self._stream(call, url)
        try:
            async for event in stream:
                started = True
                yield event
        finally:
            # refused or unreachable, and no other call of it came here: what it withdrew stands
            self._let_go.settle(call.session_id, withdrawn, ran=started)
            await stream.aclose()  # its response now, not when it is collected

    async def _stream(self, call: CallRequest, url: str) -> AsyncIterator[CallEvent]:
        # No total timeout: a long call streams for as long as it decodes. ``connect`` bounds
        # getting a connection (a pool wait included), ``sock_connect`` opening one.
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self._connect_timeout_s, sock_connect=self._connect_timeout_s
        )
        try:
            response = await self._stream_http().post(
                url, data=orjson.dumps(call.to_dict()),
                headers={**self._headers, "Content-Type": "application/json"}, timeout=timeout,
            )
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
            raise InstanceUnreachable(f"{self.instance_id}: cannot reach {url}: {exc!r}") from exc
        except aiohttp.ConnectionTimeoutError as exc:
            raise InstanceUnavailable(
                f"{self.instance_id}: no connection to {url} within {self._connect_timeout_s:g} s"
            ) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise InstanceUnavailable(f"{self.instance_id}: no answer from {url}: {exc!r}") from exc
        async with response:
            if response.status != 200:
                await self._raise_for(response)
            buffer = bytearray()  # split lines by hand: an event may exceed readline's limit
            try:
                async for chunk in response.content.iter_any():
                    searched = len(buffer)
                    buffer += chunk
                    while (end := buffer.find(b"\n", searched)) >= 0:
                        line = bytes(buffer[:end]).strip()
                        del buffer[: end + 1]
                        searched = 0
                        if line:
                            yield self._event(line)
                    if len(buffer) > self._max_event_bytes:
                        raise InstanceUnavailable(
                            f"{self.instance_id}: an event longer than {self._max_event_bytes} bytes"
                        )
                if bytes(buffer).strip():
                    yield self._event(bytes(buffer))
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                    ConnectionError) as exc:  # the process went away mid-call
                raise InstanceUnreachable(f"{self.instance_id}: stream broke: {exc!r}") from exc
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise InstanceUnavailable(f"{self.instance_id}: stream broke: {exc!r}") from exc

    def _event(self, line: bytes) -> CallEvent:
        try:
            return CallEvent.from_dict(orjson.loads(line))
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise InstanceUnavailable(
                f"{self.instance_id}: malformed event {line[:200]!r}: {exc}"
            ) from exc

    async def _raise_for(self, response: aiohttp.ClientResponse) -> None:
        body = await _json(response)
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = str(message or response.reason or response.status)
        if response.status == 429:
            raise Overloaded(f"{self.instance_id}: {message}", _retry_after(body, response))
        if 400 <= response.status < 500:
            raise CallRejected(response.status, f"{self.instance_id}: {message}")
        if response.status == 503 and isinstance(error, dict) and error.get("code") == SHUTTING_DOWN:
            raise InstanceShuttingDown(f"{self.instance_id}: {message}")
        raise InstanceUnavailable(f"{self.instance_id}: HTTP {response.status}: {message}")

    async def abort(self, call_id: str, answered: bool = False) -> None:
        url = f"{self.base_url}/internal/v1/calls/{call_id}/abort" + ("?answered=1" if answered else "")
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s)
        try:
            async with self._stream_http().post(url, headers=self._headers, timeout=timeout) as response:
                await response.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise InstanceUnavailable(f"{self.instance_id}: abort failed: {exc!r}") from exc

    def forget_sessions(self, session_ids: Iterable[str]) -> None:
        """Sessions the router let go: the next state polls tell the instance to forget them."""
        self._let_go.add_forget(session_ids)

    def release_reservations(self, session_ids: Iterable[str]) -> None:
        """Sessions gone to another instance: the next state polls release their reservations
        (unless the instance is older than that ask: its reservations then expire)."""
        if self._releases:
            self._let_go.add_release(session_ids)

    async def state(self) -> InstanceState:
        """The instance's state, its sessions merged from what changed since the last poll."""
        if self._state_lock is None:
            self._state_lock = asyncio.Lock()
        async with self._state_lock:
            try:
                state = await self._poll_state()
            except _ReleaseRefused:  # an older instance: else each later poll fails too
                log.warning("router.instance_refuses_release", instance=self.instance_id)
                self._releases = False
                self._let_go.release.clear()
                state = await self._poll_state()
                self._refused_epoch = state.epoch
            if not self._releases and state.epoch != self._refused_epoch:
                self._releases = True  # restarted (perhaps upgraded): try releases again
            return state

    async def _poll_state(self) -> InstanceState:
        url = f"{self.base_url}/internal/v1/state"
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s)
        forget, release = self._let_go.batch(MAX_FORGET)
        ask = self._cursor.ask(forget, release)
        fields = {"epoch": ask.epoch, "since": ask.since, "forget": ask.forget}
        body = orjson.dumps({**fields, "release": ask.release} if ask.release else fields)
        try:
            async with self._control_http().post(
                url, data=body, headers={**self._headers, "Content-Type": "application/json"},
                timeout=timeout,
            ) as response:
                if response.status == 400 and release and b"release" in await response.read():
                    raise _ReleaseRefused
                if response.status != 200:
                    raise InstanceUnavailable(f"{self.instance_id}: state HTTP {response.status}")
                raw = await response.read()
            if len(raw) > LARGE_REPORT_BYTES:  # a whole table (a first poll): off the loop
                parsed = await asyncio.get_running_loop().run_in_executor(None, self._parse, raw)
            else:
                parsed = self._parse(raw)
            state = self._cursor.merge(*parsed)  # here: a cancelled poll leaves it as it was
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, TypeError, KeyError) as exc:
            raise InstanceUnavailable(f"{self.instance_id}: state poll failed: {exc!r}") from exc
        self._let_go.sent()
        return state

    def _parse(self, raw: bytes) -> tuple[InstanceState, SessionsDelta | None]:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"the state is a {type(data).__name__}, not an object")
        data.setdefault("instance_id", self.instance_id)
        return parse_report(data)

    async def health(self) -> bool:
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s)
        try:
            async with self._control_http().get(
                f"{self.base_url}/health", headers=self._headers, timeout=timeout
            ) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False


async def _json(response: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = orjson.loads(await response.read())
    except (orjson.JSONDecodeError, aiohttp.ClientError):
        return {}
    return data if isinstance(data, dict) else {}


def _retry_after(body: dict[str, Any], response: aiohttp.ClientResponse) -> float:
    """Seconds to wait from a 429: the body's ``retry_after_s``, else the ``Retry-After``
    header (seconds), else 1; a value that is not a finite number >= 0 is skipped."""
    for value in (body.get("retry_after_s"), response.headers.get("Retry-After")):
        seconds = _seconds(value)
        if seconds is not None:
            return seconds
    return 1.0


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None
