"""What sessions of a trace wait for from each other during a replay: call ends, and the
tokens of calls whose prompt and output another prompt starts with (``workloads.traces.trace``:
``start_after``, ``waits_for``, ``prefix_from``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from workloads.traces.trace import CallRef, Session

__all__ = ["CallBoard"]


class CallBoard:
    """One replay's board: a call marks its end here; calls that depend on it wait here."""

    def __init__(self, sessions: Sequence[Session]) -> None:
        needed = {ref for s in sessions for ref in s.references()}
        self._keep = {c.prefix_from for s in sessions for c in s.calls if c.prefix_from is not None}
        self._ends = {ref: asyncio.Event() for ref in needed | self._keep}
        self._tokens: dict[CallRef, list[int]] = {}
        self._prompt_lengths: dict[CallRef, int] = {}

    async def wait(self, refs: Iterable[CallRef]) -> None:
        for ref in refs:
            await self._ends[ref].wait()

    async def wait_start(self, session: Session) -> None:
        """Until the calls a session's first call depends on have ended."""
        first = session.calls[0].waits_for
        await self.wait(([session.start_after] if session.start_after else []) + list(first))

    def ended(self, ref: CallRef, prompt: list[int], output: list[int]) -> None:
        event = self._ends.get(ref)
        if event is None:
            return
        if ref in self._keep:
            self._tokens[ref] = prompt + output
            self._prompt_lengths[ref] = len(prompt)
        event.set()

    def tokens(self, ref: CallRef) -> list[int]:
        """The prompt + output of an ended call that a later prompt starts with."""
        return self._tokens[ref]

    def computed(self, ref: CallRef, output_kv_reusable: bool) -> int:
        """The tokens whose KV an ended call computed (``computed_tokens``)."""
        prompt = self._prompt_lengths[ref]
        return computed_tokens(prompt, len(self._tokens[ref]) - prompt, output_kv_reusable)


def computed_tokens(prompt: int, output: int, output_kv_reusable: bool) -> int:
    """The tokens whose KV a call of ``prompt`` tokens answering ``output`` computed: its
    prompt, and its output but the last token when an output's KV is reused."""
    return prompt + (max(0, output - 1) if output_kv_reusable else 0)
