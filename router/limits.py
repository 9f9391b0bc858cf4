"""The router's bounds on one request and on all of them together.

- a session id is at most ``max_session_id_chars`` printable ASCII characters
  (:func:`check_session_id`; 400 otherwise): it is stored in both tables and echoed in a
  header;
- a prompt's size is checked before it is tokenized (:func:`prompt_bytes`, refused by
  ``router.api.prompt_tokens`` as a context overflow): no text longer than ``context length x
  max_prompt_bytes_per_token`` bytes can fit, so none is tokenized just to be refused;
- at most ``max_inflight_calls`` calls are in the router at once (tokenizing, waiting or
  streaming; a token count is one while it tokenizes): beyond, 429 with ``Retry-After``
  (:class:`InflightGate`, which also drains them at shut-down);
- the session table holds at most ``max_sessions`` (least recently seen idle ones go first),
  each with at most ``max_branches_per_session`` KV chains (``router.sessions.table``);
- a request body must arrive within ``body_timeout_s`` (408), hold at most ``max_body_items``
  JSON values (counted by its commas before it is parsed; 413; by default twice the longest
  context of the catalog, at least 262144: a token-id prompt is one value a token, and a
  conversation far fewer) and nest at most 64 levels (400); one over ``large_body_bytes`` is
  parsed off the event loop (``router.api.body_limits``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import structlog
from aiohttp import web

from router.sessions.table import BRANCH_SUFFIX_CHARS
from talaria.protocol.drain import wait_unless_hurried
from talaria.protocol.errors import bad_request, overloaded
from talaria.protocol.fields import MAX_ID_CHARS, printable_id

log = structlog.get_logger(__name__)

__all__ = [
    "LIMITS_KEY", "InflightGate", "RouterLimits", "body_items_bound", "check_session_id", "prompt_bytes",
]


# Two of them scoped (<session>:<agent>) and a branch's suffix (router.sessions.table.branch_key) fit.
MAX_SESSION_ID_CHARS = (MAX_ID_CHARS - 1 - BRANCH_SUFFIX_CHARS) // 2
MIN_BODY_ITEMS = 1 << 18


@dataclass(frozen=True)
class RouterLimits:
    max_inflight_calls: int = 1024
    max_session_id_chars: int = 256
    max_sessions: int = 100_000
    max_branches_per_session: int = 4
    max_prompt_bytes_per_token: int = 32
    body_timeout_s: float = 30.0
    max_body_items: int | None = None  # None: body_items_bound of the catalog's contexts
    large_body_bytes: int = 256 * 1024
    busy_retry_after_s: float = 1.0
    disconnect_poll_s: float = 0.5  # how often a waiting call checks its client is there

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) is None and f.name == "max_body_items":
                continue
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be > 0, got {getattr(self, f.name)!r}")
        if self.max_session_id_chars > MAX_SESSION_ID_CHARS:
            raise ValueError(
                f"max_session_id_chars must be <= {MAX_SESSION_ID_CHARS}: a scoped id "
                f"(<session>:<agent>) and a branch's suffix must stay within the {MAX_ID_CHARS} "
                "instances take"
            )


LIMITS_KEY = web.AppKey("router_limits", RouterLimits)


def body_items_bound(limits: RouterLimits, context_lens: Iterable[int]) -> int:
    """The most JSON values a body may hold: ``max_body_items``, else twice the longest
    context (at least ``MIN_BODY_ITEMS``)."""
    if limits.max_body_items is not None:
        return limits.max_body_items
    return max(MIN_BODY_ITEMS, 2 * max(context_lens, default=0))


def check_session_id(value: Any, max_chars: int, param: str = "session_id") -> str:
    """A client's session id, or 400: a non-empty string of at most ``max_chars`` printable
    ASCII characters."""
    try:
        return printable_id(value, param, max_chars)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def prompt_bytes(
    messages: list[dict[str, Any]] | None, prompt: Any, tools: list[dict[str, Any]] | None = None
) -> int:
    """UTF-8 bytes of the text a request asks to tokenize, at least: the strings of its
    messages or its prompt (0 for token ids), and the names and strings of the tool schemas
    offered (both APIs' tools, as the chat template renders them); the template only adds
    to it."""
    return _text_bytes(messages if messages is not None else prompt) + _text_bytes(tools, keys=True)


def _text_bytes(value: Any, keys: bool = False) -> int:
    """Bytes of the strings in ``value`` (and of its objects' keys when ``keys``: a tool
    schema is rendered as JSON, property names included)."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict):
        named = sum(len(str(k).encode()) for k in value) if keys else 0
        return named + sum(_text_bytes(v, keys) for v in value.values())
    if isinstance(value, list):
        return sum(_text_bytes(v, keys) for v in value)
    return 0


class InflightGate:
    """Counts the calls inside the router; ``admit`` refuses one beyond the cap with 429.
    Each admitted call's task is known until it leaves, so :meth:`drain` can end it."""

    def __init__(self, limit: int, retry_after_s: float) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    @contextmanager
    def admit(self) -> Iterator[None]:
        if self.inflight >= self.limit:
            raise overloaded(
                f"the router has {self.inflight} calls in flight (max_inflight_calls="
                f"{self.limit}); retry later", self.retry_after_s,
            )
        task = asyncio.current_task()
        self.inflight += 1
        if task is not None:
            self._tasks.add(task)
        try:
            yield
        finally:
            self.inflight -= 1
            if task is not None:
                self._tasks.discard(task)

    async def drain(
        self, timeout_s: float, grace_s: float, cut: Callable[[], None] | None = None,
        hurry: asyncio.Event | None = None,
    ) -> None:
        """Shut-down: let the calls inside finish for ``timeout_s``, or until ``hurry`` is
        set (a second signal: ``talaria.protocol.drain``); then ``cut`` ends those waiting on
        an instance as failed calls (their error event, or 503), given ``grace_s`` to answer;
        the rest are cancelled and given ``grace_s`` to leave (a cancelled call aborts itself
        on its instance)."""
        if not self._tasks:
            return
        log.info("router.draining", calls=len(self._tasks), timeout_s=timeout_s)
        await wait_unless_hurried(asyncio.wait(set(self._tasks)), timeout_s, hurry)
        left = set(self._tasks)
        if not left:
            return
        if cut is not None:
            hurried = hurry is not None and hurry.is_set()
            log.warning("router.drain_cut" if hurried else "router.drain_timeout", cutting=len(left))
            cut()
            await asyncio.wait(left, timeout=grace_s)
            left = set(self._tasks)
            if not left:
                return
        log.warning("router.drain_timeout", cancelling=len(left))
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=grace_s)
