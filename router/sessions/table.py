"""The router's session table: each session's KV chains, where their calls went, how they came back.

A session is what the client names (or the router infers); its calls need not form one
chain. Claude Code sends small side calls (a title, a command-prefix check, topic detection)
under its main loop's session id, some of another model, and a side call must not take the
main loop's place: so a session holds one :class:`SessionBranch` per KV chain, of one model,
and a call joins the branch whose chain its prompt continues (it repeats that branch's last
prompt: all its full blocks but perhaps the last, which a re-tokenised boundary between the
prompt and the answer after it may change; a prompt under one block is matched token for
token; a prompt whose template ended it with think tags counts up to them, before any
prefill, as ``router.sessions.inference`` says), the one sharing the most blocks among
several; none: it starts a branch. The
instance knows each branch as a session of its own, by the branch's ``key`` (the session id
itself for the session's first branch, ``<session id>#<n>`` for the next ones: see
:func:`branch_key`), so its reservation, KV and call history are the chain's, and a side
call never unpins, overwrites or moves the main loop's. A session holds at most
``max_branches``: a new one beyond that drops the least recently used idle branch, never the
one with the most calls (the main loop).

Times are the caller's clock (the event loop's ``loop.time()``, virtual in simulation).
A session record lives while calls are in flight and ``ttl_s`` after its last finish;
``cleanup`` drops the stale ones (and a session whose client said ``last_call`` goes when
that call ends). The table holds at most ``max_sessions``: a new session beyond that evicts
the least recently seen idle one, and ``on_evict`` hears of it (its owner forgets what else
it kept of the session); ``on_branch_drop`` hears of each branch dropped from a session.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.sessions.prefix_chain import ChainSample

__all__ = ["SessionBranch", "SessionRecord", "SessionTable", "branch_key"]

_NUMBERED = re.compile(r"#\d+\Z")
BRANCH_SUFFIX_CHARS = 16  # "#" and the branch number: room the instance's id bound leaves


def branch_key(session_id: str, n: int) -> str:
    """The id the instance knows branch ``n`` of a session by: the session id for the first
    branch, ``<session id>#<n>`` for the others. One-to-one: a session id that itself ends
    in ``#<digits>`` has ``#0`` added for its first branch too."""
    if n == 0 and not _NUMBERED.search(session_id):
        return session_id
    return f"{session_id}#{n}"


@dataclass
class SessionBranch:
    """One KV chain of a session: calls of one model whose prompts extend each other."""

    key: str  # the session id the instance knows this chain by
    model: str
    number: int = 0  # the session's branches are numbered in the order they started
    kv: ChainSample = field(default_factory=lambda: ChainSample.of(()))  # prompt + output, sampled
    prompt_blocks: int = 0  # full blocks of the prompt ``kv`` starts with
    short: tuple[int, ...] = ()  # that prompt's tokens when it is shorter than a block
    instance_id: str | None = None  # where its last call ran
    visited: set[str] = field(default_factory=set)  # every instance a call of it ran on
    kv_tokens: int = 0  # prompt + output of its last call that ran
    calls: int = 0
    active_calls: int = 0
    last_seen: float = 0.0
    last_finish: float | None = None  # when its last call ended (None: none has yet)

    def set_chain(self, prompt: Sequence[int], prompt_hashes: Sequence[int], kv: ChainSample) -> None:
        """The chain is ``kv``, which starts with ``prompt`` (``prompt_hashes``: its full blocks)."""
        self.kv, self.prompt_blocks = kv, len(prompt_hashes)
        self.short = () if prompt_hashes else tuple(prompt)

    def ran_on(self, instance_id: str, prompt: Sequence[int], prompt_hashes: Sequence[int],
               kv: ChainSample, kv_tokens: int) -> None:
        """A call of the branch ran on ``instance_id`` and left ``kv`` there (``kv_tokens``)."""
        self.instance_id, self.kv_tokens = instance_id, kv_tokens
        self.visited.add(instance_id)
        self.set_chain(prompt, prompt_hashes, kv)

    def continued_by(self, prompt: Sequence[int], hashes: Sequence[int]) -> int | None:
        """The leading blocks ``prompt`` (``hashes``: its full blocks' chain) shares with this
        chain when it continues it; None when it does not."""
        if self.prompt_blocks == 0:
            return 0 if self.short and tuple(prompt[:len(self.short)]) == self.short else None
        shared = self.kv.shared_blocks(hashes)
        return shared if shared >= max(1, self.prompt_blocks - 1) else None


@dataclass
class SessionRecord:
    session_id: str
    model: str  # of its first call
    started_at: float
    branches: OrderedDict[str, SessionBranch] = field(default_factory=OrderedDict)  # least recent first
    branches_made: int = 0
    last_finish: float | None = None
    last_seen: float = 0.0
    calls: int = 0
    active_calls: int = 0
    closing: bool = False  # its client's last call ended while others of it still ran

    @property
    def main(self) -> SessionBranch | None:
        """The branch with the most calls (the first started among equals): the agent's main loop."""
        return min(self.branches.values(), key=lambda b: (-b.calls, b.number), default=None)

    def side_calls_since(self, branch: SessionBranch) -> tuple[tuple[str, str], ...]:
        """(instance, model) of the last call of each other branch that ended after
        ``branch``'s last call did, when ``branch`` is the main loop: side calls that may have
        switched its model out where they ran. None for a side branch, or before the main
        loop's first call has ended; a side call still on its first call has run nowhere yet."""
        if branch is not self.main or branch.last_finish is None:
            return ()
        return tuple((b.instance_id, b.model) for b in self.branches.values()
                     if b is not branch and b.instance_id is not None
                     and b.last_finish is not None and b.last_finish >= branch.last_finish)

    @property
    def instance_id(self) -> str | None:
        """Where the main loop's last call ran."""
        main = self.main
        return main.instance_id if main is not None else None

    def branch_for(self, model: str, prompt: Sequence[int], hashes: Sequence[int]) -> SessionBranch | None:
        """The branch of ``model`` that ``prompt`` continues (the most blocks shared, then the
        most recent); None if none."""
        best, best_shared = None, -1
        for branch in self.branches.values():
            if branch.model != model:
                continue
            shared = branch.continued_by(prompt, hashes)
            if shared is not None and shared >= best_shared:
                best, best_shared = branch, shared
        return best

    def nearest(self, model: str, hashes: Sequence[int]) -> SessionBranch | None:
        """The branch of ``model`` whose KV shares the most leading blocks with ``hashes``
        (the most recent among equals): where a subagent's first call finds its parent's KV."""
        best, best_shared = None, -1
        for branch in self.branches.values():
            shared = branch.kv.shared_blocks(hashes) if branch.model == model else -1
            if shared >= 0 and shared >= best_shared:
                best, best_shared = branch, shared
        return best


class SessionTable:
    def __init__(self, ttl_s: float = 1800.0, max_sessions: int = 100_000, max_branches: int = 4) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {max_branches}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_branches = max_branches
        self.evicted = 0
        self.on_evict: Callable[[SessionRecord], None] | None = None
        self.on_branch_drop: Callable[[SessionBranch], None] | None = None
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def start_call(
        self, session_id: str, model: str, now: float, prompt: Sequence[int], hashes: Sequence[int],
        head: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> tuple[SessionRecord, SessionBranch, bool]:
        """Record a call's arrival: its session's record, the branch it continues (as it was
        before this call: its KV and instance are what placement reads) and whether that
        branch is new. ``hashes``: the prompt's full blocks' chain; ``head``: the part of the
        prompt and of ``hashes`` a next call of a new branch repeats (None: all of them)."""
        record = self._sessions.get(session_id)
        if record is None:
            self._make_room()
            record = SessionRecord(session_id=session_id, model=model, started_at=now)
            self._sessions[session_id] = record
        record.calls += 1
        record.active_calls += 1
        record.last_seen = now
        self._sessions.move_to_end(session_id)
        branch = record.branch_for(model, prompt, hashes)
        new = branch is None
        if branch is None:
            n = record.branches_made
            branch = SessionBranch(branch_key(session_id, n), model, n)
            record.branches_made += 1
            head_prompt, head_hashes = head or (prompt, hashes)
            branch.set_chain(head_prompt, head_hashes, ChainSample.of(
                hashes, marks=(len(hashes) - 2, len(head_hashes) - 2, len(head_hashes) - 1)))
            record.branches[branch.key] = branch
        branch.calls += 1
        branch.active_calls += 1
        branch.last_seen = now
        record.branches.move_to_end(branch.key)
        if new:
            self._drop_branches(record)  # the new branch has a call in flight: it stays
        return record, branch, new

    def _drop_branches(self, record: SessionRecord) -> None:
        """Drop least recently used idle branches beyond ``max_branches`` (not the main loop's)."""
        main = record.main
        while len(record.branches) > self.max_branches:
            victim = next((b for b in record.branches.values() if b.active_calls == 0 and b is not main), None)
            if victim is None:
                return
            del record.branches[victim.key]
            if self.on_branch_drop is not None:
                self.on_branch_drop(victim)

    def _make_room(self) -> None:
        """Evict least recently seen idle sessions until one more fits (sessions with calls
        in flight stay: the router's cap on calls in flight bounds them)."""
        while len(self._sessions) >= self.max_sessions:
            victim = next((r for r in self._sessions.values() if r.active_calls == 0), None)
            if victim is None:
                return
            del self._sessions[victim.session_id]
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(victim)

    def end_call(self, record: SessionRecord, branch: SessionBranch, now: float, last_call: bool = False) -> bool:
        """Record a call's end (where it ran: ``SessionBranch.ran_on``). Returns whether the
        session ended with it: a ``last_call`` ends it, or, when other calls of it still run
        (side calls), the last of those to end does."""
        record.active_calls = max(0, record.active_calls - 1)
        record.last_finish = record.last_seen = now
        branch.active_calls = max(0, branch.active_calls - 1)
        branch.last_finish = branch.last_seen = now
        if self._sessions.get(record.session_id) is not record:
            return False  # evicted meanwhile (it had no call in flight then) or replaced
        self._sessions.move_to_end(record.session_id)
        record.closing = record.closing or last_call
        if record.closing and record.active_calls == 0:
            del self._sessions[record.session_id]
            return True
        return False

    def cleanup(self, now: float) -> list[SessionRecord]:
        """Drop sessions idle for more than ``ttl_s``; returns what was dropped."""
        stale = [
            r for r in self._sessions.values()
            if r.active_calls == 0 and now - r.last_seen > self.ttl_s
        ]
        for record in stale:
            del self._sessions[record.session_id]
        return stale
