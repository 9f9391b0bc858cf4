"""Replaying a trace against a live router over HTTP (real engines, wall clock).

Each call is ``POST {url}/v1/completions`` with the prompt as token ids, ``max_tokens`` = the
trace's output tokens, ``ignore_eos``, greedy, ``stream`` with usage, and the session id, so
the router's placement, the instances' admission loops and their prefix caches see the
session as it is. The HTTP API returns text, not token ids, so the next prompt continues with
stand-in ids for the output (as many as were generated, from the session's seeded
generator): the previous prompt stays an exact prefix of the next one, the output's KV is
not reused (a few hundred tokens per call next to tens of thousands).

A real trace rarely fits tiny CPU models as is: :func:`scale_sessions` scales token counts
(``token_scale``) and drops calls that would not fit the model's context, and the driver
scales arrivals and tool gaps (``time_scale``).

A call that fails as an agent would see it fail (the connection breaks, the router answers
502 or 503, or the stream ends in an error event) is sent again, as an agent re-sends it,
after a short wait, up to ``MAX_RETRIES`` times; a 429 waits its ``Retry-After`` (seconds or
an HTTP date; ``BUSY_WAIT_S`` when it has none this client can read). The
target counts every re-send (``retries`` in :func:`live_replay`'s info). A call still going
at the replay's per-call timeout (``timeout_s``) fails, without a re-send, and so does one
whose stream this client cannot read (a line that is not a JSON object, usage without its
counts): that call's failure, recorded as such, never the end of the replay.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import orjson

from talaria.protocol import CallRequest
from workloads.replay.driver import CallOutcome, ReplayResult, drive
from workloads.replay.prompts import SessionTokens
from workloads.traces.assignment import assign_models
from workloads.traces.trace import Call, Session

__all__ = [
    "LiveTarget", "ServedModel", "fetch_models", "scale_sessions", "live_replay", "run_live_replay",
    "retry_after_s",
]

MAX_RETRIES = 30
RETRY_WAIT_S = 0.2  # before re-sending a failed call
BUSY_WAIT_S = 1.0  # before re-sending a 429 whose Retry-After is missing or unreadable
_RETRYABLE_STATUS = frozenset({502, 503})


class MalformedStream(ValueError):
    """The router's stream held what this client cannot read."""


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int


def base_url(url: str) -> str:
    """The router's root: ``http://host:port/v1`` (as ``talaria serve`` prints it) and
    ``http://host:port/`` both give ``http://host:port``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_models(
    http: aiohttp.ClientSession, url: str, api_key: str | None = None
) -> list[ServedModel]:
    """The served models (``/v1/models`` needs the router's ``api_key`` when it has one)."""
    url = base_url(url)
    async with http.get(f"{url}/v1/models", headers=_auth_headers(api_key)) as resp:
        if resp.status != 200:
            raise ValueError(f"{url}/v1/models answered {resp.status}: {await resp.text()}")
        data = await resp.json()
    models = [ServedModel(m["id"], int(m.get("max_model_len") or 0)) for m in data.get("data", [])]
    if not models:
        raise ValueError(f"the router at {url} serves no models")
    return models


class LiveTarget:
    def __init__(self, http: aiohttp.ClientSession, url: str, api_key: str | None = None) -> None:
        self.http = http
        self.url = base_url(url)
        self.headers = _auth_headers(api_key)
        self.retries = 0  # calls re-sent after a failure (or a 429)

    async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome:
        loop = asyncio.get_running_loop()
        body = {
            "model": request.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.params.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.session_id:  # none: the router infers it, and answers with it
            body["session_id"] = request.session_id
        payload = orjson.dumps(body)
        outcome = CallOutcome(None, loop.time(), [], error="never sent")
        for attempt in range(MAX_RETRIES + 1):
            if attempt:
                self.retries += 1
            outcome, wait_s = await self._send(request, payload, tokens)
            if wait_s is None:
                return outcome
            await asyncio.sleep(wait_s)
        return outcome

    async def _send(
        self, request: CallRequest, payload: bytes, tokens: SessionTokens
    ) -> tuple[CallOutcome, float | None]:
        """One attempt: its outcome, and how long to wait before re-sending it (None: done,
        successfully or not worth re-sending)."""
        loop = asyncio.get_running_loop()
        headers = {**self.headers, "Content-Type": "application/json"}
        first: float | None = None
        usage: tuple[int, int, int] | None = None  # output, cached, restored tokens
        error: str | None = None
        try:
            async with self.http.post(f"{self.url}/v1/completions", data=payload,
                                      headers=headers) as resp:
                if resp.status == 429:
                    wait = retry_after_s(resp.headers.get("Retry-After"))
                    return CallOutcome(None, loop.time(), [], error="HTTP 429"), wait
                if resp.status != 200:
                    text = await resp.text()
                    outcome = CallOutcome(None, loop.time(), [], error=f"HTTP {resp.status}: {text}")
                    return outcome, RETRY_WAIT_S if resp.status in _RETRYABLE_STATUS else None
                request.session_id = request.session_id or resp.headers.get("X-Session-ID", "")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = _event(data)
                    if "error" in chunk:
                        failure = chunk["error"]
                        error = str(failure.get("message", failure) if isinstance(failure, dict) else failure)
                        continue
                    if first is None and chunk.get("choices"):
                        first = loop.time()
                    if chunk.get("usage"):
                        usage = _counts(chunk["usage"])
        except (aiohttp.ClientError, ConnectionError) as exc:
            return CallOutcome(first, loop.time(), [], error=f"{type(exc).__name__}: {exc}"), RETRY_WAIT_S
        except TimeoutError:  # the session's per-call timeout: final (re-sends would multiply it)
            return CallOutcome(first, loop.time(), [], error="the call timed out"), None
        except MalformedStream as exc:  # final: the same router would answer alike
            return CallOutcome(first, loop.time(), [], error=f"malformed stream: {exc}"), None
        if usage is None or error is not None:
            why = error if error is not None else "the stream ended without usage"
            return CallOutcome(first, loop.time(), [], error=why), RETRY_WAIT_S
        n_out, cached, restored = usage
        return CallOutcome(first, loop.time(), tokens.take(n_out), cached_tokens=cached,
                           restored_tokens=restored), None


def retry_after_s(value: str | None, now: datetime | None = None) -> float:
    """A 429's ``Retry-After``: seconds, or an HTTP date (RFC 9110; a past one is now);
    ``BUSY_WAIT_S`` when it is missing or neither."""
    if value is None:
        return BUSY_WAIT_S
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return BUSY_WAIT_S
        if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else BUSY_WAIT_S


def _event(data: bytes) -> dict[str, Any]:
    """One SSE event's JSON object (:class:`MalformedStream` when it is not one)."""
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MalformedStream(f"an event that is not JSON ({exc}): {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise MalformedStream(f"an event that is not a JSON object: {data[:200]!r}")
    return chunk


def _counts(usage: Any) -> tuple[int, int, int]:
    """Output, cached and host-restored tokens of a call's usage."""
    try:
        details = usage.get("prompt_tokens_details") or {}
        return (int(usage["completion_tokens"]), int(details.get("cached_tokens", 0)),
                int(details.get("restored_tokens", 0)))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise MalformedStream(f"usage without its counts ({exc!r}): {usage!r}") from None


def scale_sessions(
    sessions: Sequence[Session], token_scale: float, max_context: int
) -> tuple[list[Session], int]:
    """Token counts times ``token_scale`` (at least 1; prompts that extend their session's
    previous one still strictly growing); calls whose prompt + output would exceed
    ``max_context`` end their session early, unless another session depends on them (an
    error then). Returns the sessions and how many calls were dropped."""
    if not token_scale > 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale}")
    out: list[Session] = []
    dropped = 0
    needed = {r for s in sessions for r in s.references()}
    for s in sessions:
        calls: list[Call] = []
        prompt = 0
        for k, c in enumerate(s.calls):
            p = max(prompt + 1 if c.extends_previous else 1, round(c.input_tokens * token_scale))
            o = max(1, round(c.output_tokens * token_scale))
            if p + o > max_context:
                dropped += len(s.calls) - k
                if any(r.session_id == s.session_id and r.call >= k for r in needed):
                    raise ValueError(f"session {s.session_id!r}: call {k} does not fit a context of "
                                     f"{max_context} tokens but other sessions depend on it; scale "
                                     "tokens down further")
                break
            kept = None if c.prefix_tokens is None else min(p, round(c.prefix_tokens * token_scale))
            calls.append(replace(c, input_tokens=p, output_tokens=o, prefix_tokens=kept))
            prompt = p
        if not calls:
            raise ValueError(
                f"session {s.session_id!r}: its first call does not fit a context of "
                f"{max_context} tokens at token_scale {token_scale}; scale tokens down further"
            )
        calls[-1] = replace(calls[-1], tool_gap_s=None)
        out.append(replace(s, calls=tuple(calls)))
    return out, dropped


async def live_replay(
    sessions: Sequence[Session], url: str, *, time_scale: float = 1.0,
    token_scale: float = 1.0, vocab_size: int = 256, seed: int = 0, progress: bool = True,
    api_key: str | None = None, skew: float = 1.0, timeout_s: float = 3600.0,
) -> tuple[ReplayResult, dict[str, int]]:
    """Replay against the router at ``url`` on the running loop. Sessions whose model the
    router does not serve are given served models (Zipf ``skew``). Returns the result and
    {"dropped_calls": n, "retries": calls re-sent after a failure}."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the router's URL must begin with http:// or https://, got {url!r}")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        served = await fetch_models(http, url, api_key)
        names = [m.name for m in served]
        mapped = list(sessions)
        if any(s.model not in names for s in mapped):
            mapped = assign_models(mapped, names, skew=skew, seed=seed)
        context = min((m.max_model_len for m in served if m.max_model_len > 0), default=0)
        if context < 2:
            raise ValueError(f"the router at {url} reports no context length for its models")
        scaled, dropped = scale_sessions(mapped, token_scale, context)
        wall = time.perf_counter()
        target = LiveTarget(http, url, api_key)
        results = await drive(
            scaled, target, seed=seed,
            vocab_of=lambda _model: vocab_size, progress=progress, desc="live",
            time_scale=time_scale, output_kv_reusable=False,
        )
        return (ReplayResult("live", results, None, time.perf_counter() - wall),
                {"dropped_calls": dropped, "retries": target.retries})


def run_live_replay(sessions: Sequence[Session], url: str, **kwargs: Any) -> tuple[
        ReplayResult, dict[str, int]]:
    """:func:`live_replay` on a fresh wall-clock loop."""
    from talaria.clock import run_live

    return run_live(live_replay(sessions, url, **kwargs))
