"""When a streamed answer commits: sends its ``200`` headers and its API's opening events.

A call's first event may be minutes away (its model's slot is another model's for up to
480 s), and a stream that sends nothing looks dead to its client: an agent's stream idle
timeout (Codex: 300 s between the events it parses), an HTTP client's read timeout (the
OpenAI and Anthropic SDKs': 600 s between bytes), a proxy's idle timeout (often 60 s). So a
streamed call commits at its first event or ``stream_commit_s`` after it was sent, whichever
comes first, and from its commit to its first event sends a keep-alive every
``stream_keepalive_s`` (each API its own: an Anthropic ``ping`` event, an SSE comment on the
OpenAI chat API, a repeated ``response.in_progress`` on the Responses API, which Codex
parses and ignores, so its idle timer restarts; it ignores comments). After it the same
keep-alive goes out whenever the stream is silent that long (``router.api.stream_keepalive``).

The invariant, who tells a client of a failure how:
- before the commit nothing is sent; a failure gets its HTTP status (``router.app._complete``
  raises it: 429 with ``Retry-After``, 503, 502, the instance's 4xx), and an answer that is
  not streamed never commits;
- after it, a failure before the first event (the instance's, the router's: overloaded, no
  instance left to retry on, the instance refusing the call) ends the stream as one after
  the first token does (:meth:`OutputAssembler.refuse` or ``fail``; each API writes its own
  error event, full queues with the delay ``Retry-After`` would have given in its message),
  never with a silent close.
``stream_commit_s`` 0 commits every stream at once (every failure is then in the stream);
None (a negative number in the serve config) only at the first event, as before it existed.
A client that leaves while its committed call waits is noticed as before (``next_or_gone``)
and its call aborted.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web

from router.api.answer_parser import AnswerParser
from router.api.openai_schema import CompletionBody
from router.api.stream_output import OutputAssembler
from router.core import CallRejected, NoHealthyInstance
from router.outcomes import InstancesShuttingDown
from talaria.protocol import CallEvent, CallRequest, Overloaded
from talaria.protocol.errors import ApiError, no_healthy_instance, overloaded
from talaria.protocol.http import next_or_gone

log = structlog.get_logger(__name__)

__all__ = ["FirstEvent", "Responder", "call_error", "check_stream_settings"]


def check_stream_settings(commit_s: float | None, keepalive_s: float) -> None:
    """ValueError naming the setting that cannot be used."""
    if commit_s is not None and not (math.isfinite(commit_s) and commit_s >= 0):
        raise ValueError(f"stream_commit_s must be a finite number >= 0, or None (commit at the first "
                         f"token), got {commit_s!r}")
    if not (math.isfinite(keepalive_s) and keepalive_s > 0):
        raise ValueError(f"stream_keepalive_s must be a finite number > 0, got {keepalive_s!r}")


def call_error(exc: Exception, call_id: str) -> ApiError:
    """The client's error for a call that could not be placed or started (what
    ``RouterCore.submit`` raises before its first event)."""
    if isinstance(exc, InstancesShuttingDown):
        return ApiError(503, f"{exc} (request id {call_id})", code="server_shutting_down")
    if isinstance(exc, NoHealthyInstance):
        return no_healthy_instance(f"{exc} (request id {call_id})")
    if isinstance(exc, Overloaded):
        return overloaded(str(exc), exc.retry_after_s)
    if isinstance(exc, CallRejected):
        return ApiError(exc.status, exc.message)
    raise TypeError(f"not a call's refusal: {exc!r}")


_REFUSALS = (NoHealthyInstance, Overloaded, CallRejected)


class FirstEvent:
    """A call's first event, awaited so that a streamed answer can commit before it.

    ``commit_s`` None: the wait is the plain ``next_or_gone`` (an answer not streamed, or the
    commit switched off). Otherwise the wait runs as a task of its own, so that the handler
    can write the stream's opening and keep-alives meanwhile without cancelling it (a
    cancelled wait would abort the call)."""

    def __init__(self, request: web.Request, events: AsyncIterator[CallEvent], call_id: str, poll_s: float,
                 commit_s: float | None = None, keepalive_s: float = 15.0) -> None:
        self._request = request
        self._call_id = call_id
        self._events = events
        self._poll_s = poll_s
        self._commit_s = commit_s
        self._keepalive_s = keepalive_s
        self._task: asyncio.Task[CallEvent | None] | None = None
        self._event: CallEvent | None = None
        self.arrived = False  # the first event is in, or the client left (no event)

    async def until_commit(self) -> None:
        """Wait for the first event until the stream's commit is due (all the way with no
        commit). A refusal before the commit is raised as its ApiError (its HTTP status)."""
        try:
            if self._commit_s is None:
                self._event = await next_or_gone(self._events, self._request, self._poll_s)
                self.arrived = True
                return
            self._task = asyncio.ensure_future(next_or_gone(self._events, self._request, self._poll_s))
            if self._commit_s > 0:
                await asyncio.wait({self._task}, timeout=self._commit_s)
            if self._task.done():
                self._event = self._task.result()
                self.arrived = True
        except _REFUSALS as exc:
            raise call_error(exc, self._call_id) from exc

    @property
    def keepalive_s(self) -> float:
        """How long a stream may stay silent before it sends a keep-alive."""
        return self._keepalive_s

    @property
    def client_left(self) -> bool:
        """The client went away before the first event (and before any commit)."""
        return self.arrived and self._event is None

    @property
    def event(self) -> CallEvent:
        """The first event, come before the commit (always, for an answer not streamed)."""
        assert self._event is not None, "the first event is not in"
        return self._event

    async def stream(
        self, out: OutputAssembler, opening: Callable[[CallEvent | None], Awaitable[None]],
        keep_alive: Callable[[], Awaitable[None]],
    ) -> CallEvent | None:
        """The first event of a streamed answer, its ``opening`` (headers and opening events;
        given the first event, or None when it commits before it) sent once, first: now if the
        event is in, else at once (the commit is due), then ``keep_alive`` every
        ``keepalive_s`` until the event comes. None: the client left while it waited. A failure
        after the commit fails ``out`` (its stream's error) and returns a finished event."""
        if self.arrived:
            await opening(self._event)
            return self._event
        assert self._task is not None, "no wait under way"
        await opening(None)
        while not (await asyncio.wait({self._task}, timeout=self._keepalive_s))[0]:
            await keep_alive()
        try:
            return self._task.result()
        except _REFUSALS as exc:
            out.refuse(call_error(exc, self._call_id))
        except Exception as exc:
            log.exception("router.first_event_failed", request_id=out.request_id)
            out.fail(f"{type(exc).__name__}: {exc}")
        return CallEvent(call_id=out.request_id, finished=True, finish_reason="error")

    async def close(self) -> None:
        """End a wait still under way (its call aborts); call it before the events close."""
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: a wait that failed after its stream gave up is no news


Responder = Callable[
    [web.Request, CompletionBody, CallRequest, OutputAssembler, FirstEvent, AsyncIterator[CallEvent],
     AnswerParser | None],
    Awaitable[web.StreamResponse],
]
"""Writes one call's answer in an API's shape: (request, body, call, assembler, its first event,
the rest of the events, the tool-call parser or None). A stream sends nothing before
:meth:`FirstEvent.stream` runs its opening."""
