"""The router's books on sessions, kept together: the session table (``router.sessions``), the
sessions inferred from prompts (``router.session_inference``) and the chains known for reuse
(``router.prefix_chain``). A session leaves all three at once, however it goes (its last
call, idle past the TTL, evicted from a full table), and its SCT is observed then.

A call is named here when it names no session: the session its prompt continues when
inference is on, else a session of one (``anon-<call id>``, ended with the call). An
inferred session's first call is tentative: it goes to the instance as its session's last
call (no soft reservation, no KV pinned for a return that one-shot calls never make) until a
second call continues it; the router keeps the session all the same, so that call can.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.prefix_chain import ChainSample, KnownChains, PromptHashes
from router.session_inference import SessionInference
from router.sessions import SessionRecord, SessionTable
from talaria.protocol import CallRequest
from talaria.protocol.text import block_hashes

__all__ = ["SessionBooks", "SessionCall"]


@dataclass
class SessionCall:
    """One call's place in its session, from its start to its end."""

    record: SessionRecord  # the session's record (as it was before this call's placement)
    parent: SessionRecord | None  # a subagent's first call: its parent's record
    prompt: PromptHashes
    ends_session: bool  # the client said this is its session's last call


class SessionBooks:
    def __init__(
        self,
        table: SessionTable,
        inference: SessionInference | None,
        block_size: int,
        known_chain_blocks: int,
        on_end: Callable[[SessionRecord], None],
    ) -> None:
        self.table = table
        table.on_evict = self._dropped
        self.inference = inference
        self.block_size = block_size
        self.chains = KnownChains(block_size, known_chain_blocks)
        self._on_end = on_end

    def start(self, call: CallRequest, prompt: PromptHashes, now: float) -> SessionCall:
        """Name the call's session if it names none, and record the call's arrival."""
        ends_session = self._name(call, prompt.hashes) if not call.session_id else call.last_call
        record = self.table.start_call(call.session_id, call.model, now, len(call.prompt_token_ids))
        return SessionCall(record, self._parent(call, record), prompt, ends_session)

    def end(
        self, call: CallRequest, books: SessionCall, instance_id: str | None, now: float,
        outputs: Sequence[int],
    ) -> list[int]:
        """Record the call's end; returns the hashes of the full blocks its answer added to
        the prompt's chain (none if it ran nowhere)."""
        hashes = books.prompt.hashes
        tail = call.prompt_token_ids[len(hashes) * self.block_size:] + list(outputs)
        more: list[int] = []
        if instance_id is not None:
            more = block_hashes(tail, self.block_size, parent=hashes[-1] if hashes else None)
        kv = ChainSample.of(hashes + more, marks=(len(hashes) - 1,))
        session_id = call.session_id
        record = self.table.end_call(
            session_id, instance_id, now, kv, len(call.prompt_token_ids) + len(outputs),
            last_call=books.ends_session,
        )
        if session_id not in self.table:
            if record is not None:
                self._on_end(record)
            self._forget(session_id)
            return more
        if instance_id is not None:
            self.chains.remember(session_id, books.prompt, tail, more)
        if self.inference is not None:
            self.inference.record_answer(session_id, outputs)
        return more

    def cleanup(self, now: float) -> int:
        """Drop the sessions idle past the table's TTL; returns how many went."""
        dropped = self.table.cleanup(now)
        for record in dropped:
            self._dropped(record)
        return len(dropped)

    def _dropped(self, record: SessionRecord) -> None:
        self._on_end(record)
        self._forget(record.session_id)

    def _forget(self, session_id: str) -> None:
        self.chains.forget(session_id)
        if self.inference is not None:
            self.inference.forget(session_id)

    def _name(self, call: CallRequest, hashes: list[int]) -> bool:
        """Name the call's session; returns whether the session ends with this call here
        (``call.last_call`` is what the instance is told)."""
        if self.inference is None:
            call.session_id, call.last_call = f"anon-{call.call_id}", True
            return True
        ends_session = call.last_call
        call.session_id = self.inference.assign(call.model, call.prompt_token_ids, hashes)
        if self.inference.calls(call.session_id) == 1:
            call.last_call = True  # tentative until a second call continues it
        return ends_session

    def _parent(self, call: CallRequest, record: SessionRecord) -> SessionRecord | None:
        """The parent's record for a subagent's first call (placement reads it as the call's
        session: the parent's instance and KV); None otherwise."""
        if record.calls != 1 or not call.parent_session_id or call.parent_session_id == call.session_id:
            return None
        parent = self.table.get(call.parent_session_id)
        return parent if parent is not None and parent.model == call.model else None
