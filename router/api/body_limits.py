"""Bounds on a request body, checked before and while it is decoded, so that nothing in
proportion to a request's size runs on the event loop unbounded:

- its length: aiohttp's ``client_max_size`` (413) before it is read;
- its items: at most ``max_items`` commas (an upper bound on its JSON values: strings' commas
  count too), counted in C before it is parsed (413 beyond). Parsing is what a body's size
  costs: a 30 MB array of token ids is five million values, parsed holding the
  interpreter's lock, so on a thread too it would hold up the loop;
- its nesting: at most :data:`MAX_JSON_DEPTH` levels, in the body and in every JSON string the
  router parses (tool-call arguments: :func:`check_depth`), else a 400 naming the field. The
  recursive walks behind (the prompt's size, the chat template, the echo of ``metadata``,
  orjson's 255 levels when answering) stay far from any recursion limit;
- a body over ``large_bytes`` is decoded, checked and parsed by the API's parser on a worker
  thread (:class:`BodyDecoder`), and so are the later walks over it (``run``), which then
  share the loop's time instead of holding it; smaller bodies are handled inline (a thread
  hop costs more than they do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson
from aiohttp import web

from router.limits import LIMITS_KEY
from talaria.protocol.errors import ApiError, bad_request
from talaria.protocol.fields import MAX_JSON_DEPTH, DepthError, json_depth
from talaria.protocol.http import read_body

__all__ = [
    "BODY_DECODER_KEY", "MAX_JSON_DEPTH", "BodyDecoder", "check_depth", "decode", "parsed_body",
    "off_loop_if_large",
]

T = TypeVar("T")



class BodyDecoder:
    """Decodes request bodies within the bounds above; one worker thread for large ones."""

    def __init__(self, max_items: int, large_bytes: int) -> None:
        self.max_items = max_items
        self.large_bytes = large_bytes
        self._pool: ThreadPoolExecutor | None = None  # made on first use

    async def decode(self, raw: bytes, parse: Callable[[Any], T]) -> T:
        """``parse(json)`` of the body, every bound checked; ApiError otherwise."""
        items = raw.count(b",") + 1
        if items > self.max_items:
            raise ApiError(
                413, f"the request body holds up to {items} JSON values (commas counted); at "
                f"most {self.max_items} are accepted", code="request_too_large",
            )
        return await self.run(len(raw) > self.large_bytes, decode, raw, parse)

    async def run(self, large: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: on the worker thread when ``large``, else here."""
        if not large:
            return fn(*args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-parse")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def decode(raw: bytes, parse: Callable[[Any], T]) -> T:
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    check_depth(data)
    return parse(data)


def check_depth(value: Any, where: str | None = None, limit: int = MAX_JSON_DEPTH) -> None:
    """400 when ``value`` nests deeper than ``limit`` (``talaria.protocol.fields.json_depth``),
    naming the field."""
    try:
        json_depth(value, where, limit)
    except DepthError as exc:
        raise bad_request(str(exc), exc.path) from None


BODY_DECODER_KEY = web.AppKey("router_body_decoder", BodyDecoder)
_LARGE_KEY = web.RequestKey("router_large_body", bool)


async def parsed_body(request: web.Request, parse: Callable[[Any], T]) -> T:
    """The request's body read (under its deadline), decoded within these bounds and parsed
    by its API's ``parse``; a large one off the event loop."""
    raw = await read_body(request, request.app[LIMITS_KEY].body_timeout_s)
    request[_LARGE_KEY] = len(raw) > request.app[LIMITS_KEY].large_body_bytes
    return await request.app[BODY_DECODER_KEY].decode(raw, parse)


async def off_loop_if_large(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a walk over the request's body: off the event loop for a large body."""
    return await request.app[BODY_DECODER_KEY].run(request.get(_LARGE_KEY, False), fn, *args)
