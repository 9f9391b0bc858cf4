"""What both servers (the router's public API, the instance's internal API) do alike over HTTP:
check a bearer key in constant time (on the header's bytes as they came: a key that is not
UTF-8 is a wrong key, never an error), read a body under a deadline, notice a client that
has gone away while its call waits for its next event, and answer the requests aiohttp cannot
parse (a header over its size limit, a bad request line) in JSON like every other error
(:class:`JsonErrorRunner`)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from talaria.protocol.errors import ApiError, unauthorized

__all__ = [
    "JsonErrorRunner", "bearer_matches", "client_gone", "header_bytes", "key_matches",
    "key_middleware", "key_problem", "next_or_gone", "read_body",
]

T = TypeVar("T")

log = structlog.get_logger(__name__)


def header_bytes(value: str) -> bytes:
    """A header value's bytes: aiohttp decodes headers as UTF-8 with ``surrogateescape``, so
    bytes that are not UTF-8 arrive as lone surrogates, which a plain ``encode()`` refuses."""
    return value.encode("utf-8", "surrogatepass")


def key_problem(key: str) -> str | None:
    """Why a configured API key cannot be used (None: it can): an empty one would read as
    no key, authentication off; one with spaces around it never matches a header, which
    is read stripped."""
    if not key.strip():
        return "is empty (leave it out to serve without a key)"
    if key != key.strip():
        return "has spaces around it, which no request's key can match"
    return None


def key_matches(value: str, key: str) -> bool:
    """Whether a header's ``value`` is ``key``, compared in constant time on bytes."""
    return hmac.compare_digest(header_bytes(value), key.encode())


def bearer_matches(request: web.Request, key: str) -> bool:
    """``Authorization: Bearer <key>``, compared in constant time."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and key_matches(token.strip(), key)


def key_middleware(key: str, protects: Callable[[str], bool]) -> Any:
    """A middleware answering 401 to requests for paths ``protects`` names that lack the key."""

    @web.middleware
    async def check_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if protects(request.path) and not bearer_matches(request, key):
            raise unauthorized()
        return await handler(request)

    return check_key


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or 408 when it has not arrived within ``timeout_s`` (a slow sender
    does not hold a connection and a handler for minutes); a client that closed its
    connection before it arrived is logged (info) and answered 499, which nobody reads: no
    internal error; a body aiohttp cannot read (one its ``Content-Encoding`` does not
    decode) is the client's error, a 400."""
    try:  # not wait_for: its frame, holding the read's future, would keep the body in a cycle
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout"
        ) from None
    except ConnectionResetError as exc:
        log.info("request.client_gone", path=request.path, error=str(exc))
        raise ApiError(499, "the client closed its connection before its request body arrived",
                       code="client_closed_request") from None
    except asyncio.CancelledError:  # a server that cancels the handler of a client that left
        if client_gone(request):
            log.info("request.client_gone", path=request.path, error="handler cancelled")
        raise
    except web.RequestPayloadError as exc:  # e.g. a body its Content-Encoding does not decode
        # aiohttp's parser stops at the error: the body ends here (else aiohttp reads on for
        # the rest and logs the error again) and the connection closes after the 400
        request.content.feed_eof()
        detail = getattr(exc.__cause__, "message", None) or str(exc)
        raise ApiError(400, f"the request body cannot be read: {detail}",
                       code="bad_request_body", close_connection=True) from None


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def next_or_gone(events: AsyncIterator[T], request: web.Request, poll_s: float) -> T | None:
    """The next item of ``events``, or None once the client of ``request`` has gone away
    (checked every ``poll_s`` by one watcher per request, not a task per item). The wait for
    the item is cancelled only when the client is gone, so an async generator's ``finally``
    runs then (and aborts its call)."""
    watch = request.get(_WATCH_KEY)
    if watch is None:
        watch = request[_WATCH_KEY] = _ClientWatch(request, poll_s)
    return await watch.next(events)


class _ClientWatch:
    """Watches one request's client while its handler runs: one task, waking every
    ``poll_s``; when the client has gone it ends the wait in progress (through that wait's
    timeout scope, which tells the cancellation it causes from any other) and every later one."""

    def __init__(self, request: web.Request, poll_s: float) -> None:
        self._request = request
        self._poll_s = poll_s
        self._scope: asyncio.Timeout | None = None
        self._task: asyncio.Task[None] | None = None
        self.gone = False

    async def next(self, events: AsyncIterator[T]) -> T | None:
        if self.gone:
            return None
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())
            self._request.task.add_done_callback(lambda _handler: self._stop())
        try:
            async with asyncio.timeout(None) as scope:
                self._scope = scope
                try:
                    return await anext(events)
                finally:
                    self._scope = None
        except TimeoutError:
            if self.gone:
                return None
            raise

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while not client_gone(self._request):
            await asyncio.sleep(self._poll_s)
        self.gone = True
        if self._scope is not None:
            self._scope.reschedule(loop.time())

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


_WATCH_KEY = web.RequestKey("talaria_client_watch", _ClientWatch)


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors in the APIs' JSON shape."""

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises once a reply began
        if status >= 500:
            text = "internal error"
        else:
            detail = getattr(exc, "message", None) or message or (str(exc) if exc else "")
            text = f"the request cannot be parsed as HTTP: {detail}".rstrip(": ")
        response = ApiError(status, text, code="bad_http_request" if status < 500 else None).response()
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """An AppRunner whose connections answer what never reaches the app (a request aiohttp
    cannot parse: a header over 8190 bytes, a bad request line) with the JSON error body the
    app's middleware gives everything else, not aiohttp's text/plain."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # the same server; only its handler class differs
        return server
