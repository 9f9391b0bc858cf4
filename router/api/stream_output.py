"""Turns a call's CallEvents into the text the client sees: detokenise, cut at stop strings,
split a thinking model's reasoning from its answer (``router.api.reasoning``; after the stop
strings, so one inside the reasoning ends the answer there, as vLLM's do), keep logprobs (of
the tokens up to the one that completed a stop string: ``router.api.stop_cut``; never of the
end-of-turn token that ended the answer) and usage.
One assembler per call; the streaming and the collecting handler share it, so both answer
the same text. A failure the instance reports becomes a generic
``error`` naming the request id (the detail goes to the log), and :func:`next_event` waits
for a call's next event while watching that its client is still there."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from aiohttp import web

from router.api import openai_schema as schema
from router.api.answer_parser import AnswerParser
from router.api.reasoning import ReasoningSplitter
from router.api.stop_cut import feed_tokens
from router.api.stream_keepalive import KeepAlive
from router.limits import LIMITS_KEY
from router.outcomes import ShutDown, ShutDownEvent
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallUsage
from talaria.protocol.errors import ApiError
from talaria.protocol.http import next_or_gone
from talaria.protocol.text import StopMatcher

log = structlog.get_logger(__name__)


@dataclass
class Piece:
    """What one event added: text safe to send (the answer's content, and before it any
    reasoning, which a model without a reasoning parser never has), and its tokens'
    logprobs if asked for."""

    text: str = ""
    reasoning: str = ""
    tokens: list[bytes] = field(default_factory=list)  # each token's own bytes
    logprobs: list[float] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # where each token starts in the answer


class OutputAssembler:
    def __init__(
        self, tok: ModelTokenizer, prompt_ids: Sequence[int], stops: Sequence[str],
        want_logprobs: bool, request_id: str = "", keep_tags: Sequence[str] = (),
        reasoning: ReasoningSplitter | None = None,
    ) -> None:
        """``keep_tags``: the tool format's tags, kept in the text where the vocabulary
        marks them special (its parser must see them; other special tokens are skipped), as
        are the reasoning tags when ``reasoning`` splits the answer."""
        self.request_id = request_id
        self._tok = tok
        tags = [*keep_tags, *(reasoning.tags if reasoning is not None else ())]
        self._keep = tok.special_ids(tags) if tags else []
        self.reasoning_splitter = reasoning
        self._reasoning: list[str] = []
        self._detok = tok.detokenizer(prompt_ids, self._keep)
        self._stop = StopMatcher(stops)
        self._has_stops = any(stops)
        self._want_logprobs = want_logprobs
        self._text: list[str] = []
        self._all = Piece()
        self._chars = 0  # characters the answer's tokens have completed (logprobs' offsets)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.prompt_tokens = len(prompt_ids)
        self.token_ids: list[int] = []
        self.reported: CallUsage | None = None
        self.reported_final = False  # ``reported`` came with the event that finished the call
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_code = "instance_failed"
        self.error_status = 502
        self.refusal: ApiError | None = None  # the call's refusal, after its stream committed
        self.done = False
        self.settled = False  # the answer was whole before its call ended (``settle``)

    def add(self, event: CallEvent) -> Piece:
        if self.done:
            return Piece()
        if event.usage is not None:
            self.reported, self.reported_final = event.usage, event.finished
        cut = feed_tokens(self._detok, self._stop, event.token_ids, event.finished, self._has_stops)
        stopped, kept = cut.stopped, event.token_ids[: cut.kept]  # none past a stop string
        self.token_ids.extend(kept)
        piece = self._split(cut.text, len(kept))
        if self._want_logprobs and kept:
            tokens = self._tok.token_bytes(kept)
            offsets = []
            for token in tokens:  # a token inside a character starts at that character
                offsets.append(self._chars)
                self._chars += len(self._utf8.decode(token))
            if event.logprobs:  # every event's tokens count towards the offsets
                listed = len(kept) - self._ended_by_stop_token(event, stopped, kept)
                piece.tokens, piece.offsets = tokens[:listed], offsets[:listed]
                piece.logprobs = event.logprobs[:listed]
                self._all.tokens += piece.tokens
                self._all.logprobs += piece.logprobs
                self._all.offsets += piece.offsets
        if stopped:
            self.finish_reason, self.done = "stop", True
        elif event.finished:
            self.done = True
            self.finish_reason = event.finish_reason or "stop"
            if isinstance(event, ShutDownEvent):
                self.cut(event.shut_down)
            elif self.ends_in_failure(event):
                self.fail(event.error or "the instance aborted the call")
        return piece

    def _ended_by_stop_token(self, event: CallEvent, stopped: bool, kept: list[int]) -> bool:
        """The instance ended the answer at a stop token (an EOS: the router asks for no
        other), its last: one the text leaves out. OpenAI's logprobs never list it, so the
        answer's leave it out (its id still counts in the usage)."""
        return (event.finished and event.finish_reason == "stop" and not stopped and bool(kept)
                and len(kept) == len(event.token_ids) and self._tok.is_skipped(kept[-1], self._keep))

    @staticmethod
    def ends_in_failure(event: CallEvent) -> bool:
        """The event ends its call in failure (an error, or an abort by the instance)."""
        return event.finished and (event.error is not None or event.finish_reason in ("error", "abort"))

    def raise_if_failed(self) -> None:
        """A failed call is a 502 (``instance_failed``) naming only the request id, however
        far it got: before its first token (streamed or not) or in a collected answer; one
        cut as the router or its instance shut down a 503 (``server_shutting_down``)."""
        if self.error is not None:
            raise ApiError(self.error_status, self.error, code=self.error_code)

    def settle(self) -> None:
        """Nothing more of the call's output can reach its answer (``AnswerParser.settled``):
        the answer ends here, its usage the tokens received."""
        self.done, self.settled, self.finish_reason = True, True, "stop"

    def fail(self, detail: str) -> None:
        """The call failed: log ``detail``; the client is told only that, and the id."""
        log.warning("router.call_failed", request_id=self.request_id, error=detail)
        self.error = f"the call failed on its instance; request id {self.request_id}"
        self.done = True

    def cut(self, who: ShutDown) -> None:
        """A shut-down cut the call (the router's or its instance's: a ``ShutDownEvent``): the
        client is told who is shutting down, and the id, a 503 to retry."""
        self.error = f"{who.value} is shutting down; request id {self.request_id}"
        self.error_code, self.error_status = "server_shutting_down", 503
        self.done = True

    def refuse(self, error: ApiError) -> None:
        """The call was refused before its first event, after its stream committed
        (``router.api.stream_commit``): the client gets ``error`` in the stream, its message
        and its status's kind, as it would have got its HTTP status before the commit. The
        delay its ``Retry-After`` would have given ends the message as OpenAI's rate limits
        say it, ``Please try again in 3s.`` (Codex reads it there), since no header can."""
        log.warning("router.call_refused_in_stream", request_id=self.request_id, status=error.status,
                    error=error.message)
        retry = error.headers.get("Retry-After")
        if retry is not None:
            error = ApiError(error.status, f"{error.message.rstrip('.')}. Please try again in {retry}s.",
                             param=error.param, code=error.code, error_type=error.error_type, extra=error.extra)
        self.refusal = error
        self.error = error.message
        self.done = True

    def stream_error(self) -> ApiError:
        """The failure as a stream tells it: the refusal, else ``error_status`` (502, or 503 at
        the shut-down) with ``error_code``."""
        assert self.error is not None, "the call has not failed"
        return self.refusal or ApiError(self.error_status, self.error, code=self.error_code)

    def check_calls(self, answer: AnswerParser | None, ended: bool = False) -> None:
        """Fail a stream whose announced tool call broke (``AnswerParser.failure``; ``ended``:
        the answer's finish reason is final), telling the client why."""
        why = answer.failure(self.finish_reason if ended else None) if answer is not None else None
        if why is None or self.error is not None:
            return
        log.warning("router.tool_call_broken", request_id=self.request_id, error=why)
        self.error, self.error_code = f"{why}; request id {self.request_id}", "malformed_tool_call"
        self.done = True

    def _split(self, text: str, tokens: int, final: bool = False) -> Piece:
        """``text`` as the answer's content and reasoning (kept for the collected answer)."""
        splitter = self.reasoning_splitter
        if splitter is None:
            self._text.append(text)
            return Piece(text=text)
        split = splitter.feed(text, tokens)
        if final:
            rest = splitter.finish()
            split.reasoning, split.content = split.reasoning + rest.reasoning, split.content + rest.content
        self._reasoning.append(split.reasoning)
        self._text.append(split.content)
        return Piece(text=split.content, reasoning=split.reasoning)

    def flush(self) -> Piece:
        """Release text held back for a possible stop string or reasoning tag (call it once,
        at the end; later calls release nothing)."""
        return self._split(self._stop.flush(), 0, final=True)

    @property
    def text(self) -> str:
        """The answer's content (its reasoning left out)."""
        self.flush()
        return "".join(self._text)

    @property
    def reasoning(self) -> str:
        """The answer's reasoning ("" for a model without a reasoning parser)."""
        self.flush()
        return "".join(self._reasoning)

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning_splitter.reasoning_tokens if self.reasoning_splitter is not None else 0

    @property
    def stopped_at_string(self) -> bool:
        """A stop string ended the answer here (its instance may not have finished it)."""
        return self._stop.stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the answer (None when none did): the one the matcher cut
        the streamed text at. That text was decoded after the prompt's tail, as the client got
        it; a decode of the answer alone can differ at its start (a SentencePiece word piece
        there loses its space) and miss a stop string the stream matched."""
        return self._stop.matched

    def answered_usage(self) -> CallUsage | None:
        """The usage of an answer whole before its call ended (a stop string, ``settle``) as
        its API tells it: the prompt, cached and restored tokens its instance reported with its
        first tokens and the tokens the answer kept; None if no usage came."""
        kept = len(self.token_ids)
        return replace(self.reported, completion_tokens=kept) if self.reported is not None else None

    def usage(self) -> dict[str, Any]:
        reported = self.reported
        prompt = reported.prompt_tokens if reported else self.prompt_tokens
        # The instance's count is final only on its last event; an answer cut here (a stop
        # string, a broken tool call) or failing mid-call counts the tokens received (up to
        # the one that completed a stop string, as its logprobs do).
        final = self.reported_final and not self._stop.stopped
        completion = reported.completion_tokens if reported and final else len(self.token_ids)
        cached = reported.cached_tokens if reported else 0
        restored = reported.restored_tokens if reported else 0
        usage = schema.usage_dict(prompt, completion, cached, restored)
        if self.reasoning_splitter is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": min(self.reasoning_tokens, completion)}
        return usage

    def chat_logprobs(self, piece: Piece | None = None) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        piece = piece or self._all
        return schema.chat_logprobs(piece.tokens, piece.logprobs)

    def completion_logprobs(self, piece: Piece | None = None) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        piece = piece or self._all
        return schema.completion_logprobs(piece.tokens, piece.logprobs, piece.offsets)


async def collect(
    request: web.Request, out: OutputAssembler, event: CallEvent, events: AsyncIterator[CallEvent],
    emit: Callable[[Piece], Awaitable[None]] | None = None, answer: AnswerParser | None = None,
    keep_alive: KeepAlive | None = None,
) -> bool:
    """Feed the call's events to ``out`` (and each piece to ``emit``) until it is done; False
    if the client left first. Anything failing here but the client's connection fails the
    call (``out.error``), so its answer still says so. ``answer``: the tool-call parser, fed
    by ``emit`` in a stream (a watcher of its own reads a collected answer's text): once it is
    ``settled``, so is ``out``, and the caller ends the call as answered. ``keep_alive``: a
    stream's, asked after each event that leaves the answer open (one that sent nothing
    may have left the stream silent too long, ``router.api.stream_keepalive``)."""
    watch = answer.watcher() if answer is not None and emit is None else answer
    try:
        while True:
            piece = out.add(event)
            if emit is not None:
                await emit(piece)
            elif watch is not None:
                watch.feed(piece.text)
            if not out.done and watch is not None and watch.settled:
                out.settle()
            if out.done:
                return True
            if keep_alive is not None:
                await keep_alive.if_idle()
            following = await next_event(request, events)
            if following is None:
                log.info("router.client_disconnected", request_id=out.request_id)
                return False
            event = following
    except ConnectionError:
        raise
    except Exception as exc:
        log.exception("router.stream_failed", request_id=out.request_id)
        out.fail(f"{type(exc).__name__}: {exc}")
        return True


async def next_event(request: web.Request, events: AsyncIterator[CallEvent]) -> CallEvent | None:
    """The call's next event, or None once its client has gone away."""
    return await next_or_gone(events, request, request.app[LIMITS_KEY].disconnect_poll_s)

