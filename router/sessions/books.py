"""The router's books on sessions, kept together: the session table and its branches
(``router.sessions.table``), the sessions inferred from prompts (``router.sessions.inference``) and
the chains known for reuse (``router.sessions.prefix_chain``, one per branch). A session leaves all
three at once, however it goes (its last call, idle past the TTL, evicted from a full
table), and its SCT is observed then; a branch dropped from its session takes its known
chain with it.

A call is named here when it names no session: the session its prompt continues when
inference is on, else a session of one (``anon-<call id>``, ended with the call). The call
the instance receives names the call's branch (``SessionBranch.key``), not the session.
First calls are tentative: an inferred session's first call, and the first call of a
session's second or later branch (a side call, most of the time), go to the instance as
their chain's last call (no soft reservation, no KV pinned for a return that one-shot calls
never make) until a second call continues them; the router keeps them all the same, so that
call can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.sessions.inference import SessionInference
from router.sessions.prefix_chain import ChainSample, KnownChains, PromptHashes
from router.sessions.table import SessionBranch, SessionRecord, SessionTable
from talaria.protocol import CallRequest
from talaria.protocol.text import block_hashes

__all__ = ["SessionBooks", "SessionCall"]


@dataclass
class SessionCall:
    """One call's place in its session, from its start to its end."""

    record: SessionRecord
    branch: SessionBranch  # the chain the call continues (as it was before the call ran)
    view: SessionBranch  # what placement reads: the branch, or a subagent's first call's parent's
    affinity: str | None  # an instance preferred among equals (a subagent's parent's)
    prompt: PromptHashes
    sent: CallRequest  # the call as the instance receives it (its branch's key, tentative or not)
    ends_session: bool  # the client said this is its session's last call
    repeated: int | None = None  # of its prompt's tokens, those the next prompt repeats (None: all)


class SessionBooks:
    def __init__(
        self,
        table: SessionTable,
        inference: SessionInference | None,
        block_size: int,
        known_chain_blocks: int,
        on_end: Callable[[SessionRecord], None],
        forget: Callable[[str, list[str]], None] | None = None,
    ) -> None:
        """``on_end``: a session left the books. ``forget(instance_id, keys)``: branch keys
        (the session ids instances know) that instance holds and the router let go: every
        branch of a session that ended, on every instance a call of it ran on (an instance it
        left holds its KV, released but cached, and its history), and a branch dropped beyond
        the table's bound."""
        self.table = table
        table.on_evict = self._dropped
        table.on_branch_drop = self._branch_dropped
        self.inference = inference
        self.block_size = block_size
        self.chains = KnownChains(block_size, known_chain_blocks)
        self._on_end = on_end
        self._forget = forget

    def chain_keys(self, call: CallRequest) -> list[str] | None:
        """The known chains ``call``'s prompt may reuse: its session's branches of its model
        (None: the call names no session yet; ``KnownChains.hash_prompt``)."""
        if not call.session_id:
            return None
        record = self.table.get(call.session_id)
        return [b.key for b in record.branches.values() if b.model == call.model] if record else []

    def start(self, call: CallRequest, prompt: PromptHashes, now: float,
              repeated: int | None = None) -> SessionCall:
        """Name the call's session if it names none, and record the call's arrival.
        ``repeated``: how many of its prompt's tokens its session's next prompt repeats (None:
        all; ``SessionInference.assign``)."""
        tentative = False
        if not call.session_id:
            ends_session, tentative = self._name(call, prompt.hashes, repeated)
        else:
            ends_session = call.last_call
        record, branch, new = self.table.start_call(
            call.session_id, call.model, now, call.prompt_token_ids, prompt.hashes,
            self._head(call.prompt_token_ids, prompt.hashes, repeated))
        tentative = tentative or (new and record.calls > 1)  # a new chain in a known session
        parent = self._parent(call, record, prompt.hashes)
        sent = dataclasses.replace(call, session_id=branch.key, last_call=call.last_call or tentative)
        return SessionCall(record, branch, parent or branch, parent.instance_id if parent else None,
                           prompt, sent, ends_session, repeated)

    def end(
        self, call: CallRequest, books: SessionCall, instance_id: str | None, now: float,
        outputs: Sequence[int],
    ) -> list[int]:
        """Record the call's end; returns the hashes of the full blocks its answer added to
        the prompt's chain (none if it ran nowhere)."""
        hashes = books.prompt.hashes
        tail = call.prompt_token_ids[len(hashes) * self.block_size:] + list(outputs)
        more: list[int] = []
        branch = books.branch
        if instance_id is not None:
            more = block_hashes(tail, self.block_size, parent=hashes[-1] if hashes else None)
            head, head_hashes = self._head(call.prompt_token_ids, hashes, books.repeated)
            kv = ChainSample.of(hashes + more, marks=(len(hashes) - 2, len(hashes) - 1,
                                                      len(head_hashes) - 2, len(head_hashes) - 1))
            branch.ran_on(instance_id, head, head_hashes, kv, len(call.prompt_token_ids) + len(outputs))
        if self.table.end_call(books.record, branch, now, last_call=books.ends_session):
            self._dropped(books.record)
            return more
        if books.record.session_id not in self.table:
            return more  # evicted while the call ran: forgotten then
        if instance_id is not None and branch.key in books.record.branches:
            self.chains.remember(branch.key, books.prompt, tail, more)
        if self.inference is not None:
            self.inference.record_answer(call.session_id, outputs)
        return more

    def cleanup(self, now: float) -> int:
        """Drop the sessions idle past the table's TTL; returns how many went."""
        dropped = self.table.cleanup(now)
        for record in dropped:
            self._dropped(record)
        return len(dropped)

    def _dropped(self, record: SessionRecord) -> None:
        self._on_end(record)
        held: dict[str, list[str]] = {}  # instance -> keys of the branches that ran there
        for branch in record.branches.values():
            self.chains.forget(branch.key)
            for instance_id in sorted(branch.visited):
                held.setdefault(instance_id, []).append(branch.key)
        if self._forget is not None:
            for instance_id, keys in held.items():
                self._forget(instance_id, keys)
        if self.inference is not None:
            self.inference.forget(record.session_id)

    def _branch_dropped(self, branch: SessionBranch) -> None:
        self.chains.forget(branch.key)
        if self._forget is not None:
            for instance_id in sorted(branch.visited):
                self._forget(instance_id, [branch.key])

    def _head(self, prompt: Sequence[int], hashes: list[int],
              repeated: int | None) -> tuple[Sequence[int], list[int]]:
        """The part of a prompt (and of its full blocks' ``hashes``) its session's next prompt
        repeats, which a branch's next call must: its first ``repeated`` tokens (None: all)."""
        if repeated is None:
            return prompt, hashes
        return prompt[:repeated], hashes[:repeated // self.block_size]

    def _name(self, call: CallRequest, hashes: list[int], repeated: int | None) -> tuple[bool, bool]:
        """Name the call's session; returns whether the session ends with this call here, and
        whether the call is tentative (an inferred session's first)."""
        if self.inference is None:
            call.session_id, call.last_call = f"anon-{call.call_id}", True
            return True, False
        call.session_id = self.inference.assign(call.model, call.prompt_token_ids, hashes, repeated,
                                                taken=self.table.__contains__)
        return call.last_call, self.inference.calls(call.session_id) == 1

    def _parent(self, call: CallRequest, record: SessionRecord, hashes: list[int]) -> SessionBranch | None:
        """The parent's branch for a subagent's first call (placement reads it as the call's
        session: the parent's instance and KV; the branch whose KV the prompt shares most);
        None otherwise."""
        if record.calls != 1 or not call.parent_session_id or call.parent_session_id == call.session_id:
            return None
        parent = self.table.get(call.parent_session_id)
        return parent.nearest(call.model, hashes) if parent is not None else None
