"""Session KV bookkeeping of the simulated engine: what it remembers of a session's last
call, where that session's KV is, and the host KV index seen as the KV manager's secondary
cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockChain
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from substrate.host_kv_index import ChainLookups, HostKVIndex

__all__ = ["HostKVSecondary", "SessionRecord", "SimSessions"]


@dataclass
class SessionRecord:
    """The last finished call of a session: its model, its KV block-hash chain (full blocks
    whose KV was computed) and its tokens (to reuse the chain for the next prompt; empty once
    ``SimSessions`` has let them go)."""

    model: str
    block_hashes: list[int]
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]

    def starts(self, tokens: Sequence[int], n: int) -> bool:
        """Whether ``tokens[:n]`` equals this call's first ``n`` tokens (n within them)."""
        prompt = self.prompt_token_ids
        p = min(n, len(prompt))
        if tokens[:p] != (prompt if p == len(prompt) else prompt[:p]):
            return False
        return n == p or tokens[p:n] == self.output_token_ids[: n - p]


class HostKVSecondary:
    """The host KV index as the KV manager's secondary cache for one model; counts the blocks
    loaded so the step that restores them is charged for the copy."""

    def __init__(self, index: HostKVIndex, model: str) -> None:
        self.index = index
        self.model = model
        self.loaded_blocks = 0

    def lookup(self, block_hashes: list[int]) -> int:
        return self.index.lookup(self.model, block_hashes, touch=False)

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        self.index.touch(self.model, block_hashes)
        self.loaded_blocks += len(block_hashes)


class SimSessions:
    """Each session's last finished call (model, block-hash chain, tokens) and where its KV
    is: device blocks of the active model's KV manager, blocks in the host KV index.

    A record keeps its call's tokens for ``keep_tokens_s`` of ``clock`` after the call
    finished (either None: for as long as the session is remembered), then its block hashes
    only; records are swept when another call of the engine finishes.
    The tokens only spare the session's next prompt the hashing of the blocks it shares with
    this call; a session back after longer hashes its whole prompt (to the same hashes:
    tokens alone decide them), so results do not depend on it, and memory grows with the
    sessions active lately instead of every session the engine has seen (a prompt's tokens
    are megabytes, its block hashes kilobytes)."""

    def __init__(self, host_kv: HostKVIndex, block_size: int,
                 clock: Callable[[], float] | None = None,
                 keep_tokens_s: float | None = None) -> None:
        self.host_kv = host_kv
        self.block_size = block_size
        self.records: dict[str, SessionRecord] = {}
        self._host = ChainLookups(host_kv)  # the loop asks for every session every refresh
        self._clock = clock
        self._keep_tokens_s = keep_tokens_s
        self._holding: dict[str, float] = {}  # sessions whose record has tokens -> finished at

    def remember(self, model: str, req: Request, kv: KVCacheManager) -> None:
        """``req`` (of ``model``) finished: its chain is the session's prefix now."""
        sid = req.session_id
        if sid is None:
            return
        self.records[sid] = SessionRecord(
            model, kv.session_block_hashes(sid), req.prompt_token_ids, list(req.output_token_ids)
        )
        if self._clock is not None and self._keep_tokens_s is not None:
            now = self._clock()
            self._holding.pop(sid, None)
            self._holding[sid] = now  # oldest first: re-inserted at its latest call
            self._let_tokens_go(now - self._keep_tokens_s)

    def _let_tokens_go(self, before: float) -> None:
        """Records of calls that finished before ``before`` keep their block hashes only."""
        while self._holding:
            sid, finished = next(iter(self._holding.items()))
            if finished >= before:
                return
            del self._holding[sid]
            record = self.records.get(sid)
            if record is not None:
                record.prompt_token_ids, record.output_token_ids = [], []

    def prompt_hashes(self, req: Request, chain: BlockChain | None) -> tuple[list[int], int]:
        """``req``'s leading block hashes known without hashing its prompt, and how many of
        them its session's last call already checked (its tokens are valid: the engine
        checks only the rest). With the prompt's ``chain`` (``BlockChain.of``): a copy of it
        (the request extends its own), checked as far as it equals the last call's chain
        (equal hashes name equal tokens); else ``reusable_hashes``, all checked."""
        hashes = chain.of(len(req.prompt_token_ids), self.block_size) if chain else None
        if hashes is None:
            reused = self.reusable_hashes(req)
            return reused, len(reused)
        prev = self.records.get(req.session_id) if req.session_id is not None else None
        if prev is None:
            return list(hashes), 0
        known = prev.block_hashes
        n = min(len(known), len(hashes))
        if known[:n] != hashes[:n]:
            n = next(i for i, (a, b) in enumerate(zip(known, hashes, strict=False)) if a != b)
        return list(hashes), n

    def reusable_hashes(self, req: Request) -> list[int]:
        """The leading block hashes of ``req`` already known from its session's last call
        (the longest block prefix whose tokens match), so a 100k-token continuation hashes
        only its new blocks. Hashes depend on tokens only, never on where the KV lives."""
        prev = self.records.get(req.session_id) if req.session_id is not None else None
        if prev is None or not prev.block_hashes or not prev.prompt_token_ids:
            return []
        bs = self.block_size
        prompt = req.prompt_token_ids
        hi = min(len(prev.block_hashes), len(prompt) // bs)
        if prev.starts(prompt, hi * bs):
            return prev.block_hashes[:hi]
        lo = 0  # invariant: the first lo blocks match, block hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if prev.starts(prompt, mid * bs):
                lo = mid
            else:
                hi = mid
        return prev.block_hashes[:lo]

    def offload(
        self, model: str, kv: KVCacheManager, session_ids: list[str] | None, block_bytes: int
    ) -> int:
        """Copy the device KV of ``model``'s sessions (None: all) into the host index; blocks
        already there are only touched. Returns the number of blocks copied."""
        wanted = None if session_ids is None else set(session_ids)
        copied = 0
        for sid, sess in self.records.items():
            if sess.model != model or (wanted is not None and sid not in wanted):
                continue
            on_device = kv.session_cached_blocks(sid)
            if on_device:
                result = self.host_kv.insert_chain(
                    model, sess.block_hashes[:on_device], block_bytes, session_id=sid
                )
                copied += len(result.inserted)
        return copied

    def kv_tokens(
        self, session_id: str, active: str | None, kv: KVCacheManager | None
    ) -> tuple[int, int]:
        """(tokens of the session's last prefix cached on device, tokens in the host index)."""
        sess = self.records.get(session_id)
        if sess is None:
            return (0, 0)
        bs = self.block_size
        device = 0
        if sess.model == active and kv is not None:
            device = kv.session_cached_blocks(session_id) * bs
        if self.host_kv.capacity_bytes == 0:  # an index without room never holds a block
            return (device, 0)
        return (device, self._host.lookup(session_id, sess.model, sess.block_hashes) * bs)

    def forget(self, session_id: str) -> None:
        self.records.pop(session_id, None)
        self._holding.pop(session_id, None)
        self._host.forget(session_id)
