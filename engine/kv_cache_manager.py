"""Which KV blocks each request holds, prefix caching, the secondary-cache and session hooks.

Torch-free (the simulated engine reuses it with a cost model instead of tensors).

Who frees what:
- a request references its blocks from ``allocate_slots`` until ``free`` (finish, abort or
  preemption); ``free`` releases them tail first, so a prefix's last blocks are evicted
  before its first ones;
- a block is registered in the prefix map (``cache_computed_blocks``) only once its KV has
  been computed (after the step that computed it), or right after a secondary-cache load;
- a pinned session holds one extra reference on each of its cached blocks until
  ``unpin_session`` (or ``reset``, which drops everything: a model switch).

Prefix lookup never covers a request's last token: its logits must be computed, so at least
one token is always prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.block_hash import hash_block_tokens
from engine.block_pool import BlockPool
from engine.request import Request
from substrate.prefix_presence import PrefixPresence


@runtime_checkable
class SecondaryKVCache(Protocol):
    """A slower KV store behind the device prefix cache (e.g. the host KV store)."""

    def lookup(self, block_hashes: list[int]) -> int:
        """How many leading hashes of ``block_hashes`` the store holds."""
        ...

    def load(self, block_hashes: list[int], block_ids: list[int]) -> None:
        """Copy the KV of these hashes into these (freshly allocated) device blocks."""
        ...


@dataclass
class ComputedPrefix:
    """Result of a prefix lookup: nothing is referenced until ``allocate_slots``."""

    block_ids: list[int] = field(default_factory=list)  # device prefix-cache hits
    restore_hashes: list[int] = field(default_factory=list)  # next blocks the secondary holds
    block_size: int = 16

    @property
    def num_device_tokens(self) -> int:
        return len(self.block_ids) * self.block_size

    @property
    def num_restored_tokens(self) -> int:
        return len(self.restore_hashes) * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_device_tokens + self.num_restored_tokens


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        secondary: SecondaryKVCache | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.secondary = secondary
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[int]] = {}
        self._req_num_hashed: dict[str, int] = {}
        # each session's remembered chain, and how much of it the prefix map still holds
        self._sessions = PrefixPresence(self.pool.hash_membership())
        self.pool.presence = self._sessions
        self._pins: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ hashes
    def block_hashes(self, request: Request) -> list[int]:
        """The request's full-block hash chain, extended to its current tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = request.num_tokens // bs
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, request.token_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)
        return hashes

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, request: Request) -> ComputedPrefix:
        """Longest cached prefix of the request's tokens (device, then secondary),
        leaving at least the last token to compute. Side-effect free."""
        prefix = ComputedPrefix(block_size=self.block_size)
        if not self.enable_prefix_caching:
            return prefix
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request)[:max_blocks]
        prefix.block_ids = self.pool.lookup_prefix(hashes)
        rest = hashes[len(prefix.block_ids):]
        if self.secondary is not None and rest:
            found = self.secondary.lookup(list(rest))
            prefix.restore_hashes = list(rest[: max(0, min(found, len(rest)))])
        return prefix

    # -------------------------------------------------------------- allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: ComputedPrefix | None = None
    ) -> bool:
        """Make the request's blocks cover ``num_computed_tokens + num_new_tokens`` tokens.

        ``prefix`` (first admission only) is referenced, and its restore part is loaded from
        the secondary cache into fresh blocks. Returns False, changing nothing, when too few
        blocks are free.
        """
        bs = self.block_size
        rid = request.request_id
        if prefix is not None:
            if rid in self._req_blocks:
                raise RuntimeError(f"request {rid!r} already holds KV blocks")
            hits = prefix.block_ids
            hits_free = self.pool.count_unreferenced(hits)
            need = -(-(prefix.num_tokens + num_new_tokens) // bs) - len(hits)
            if need > self.pool.num_free_blocks - hits_free:
                return False
            self.pool.touch(hits)
            new = self.pool.allocate(need)
            restored = new[: len(prefix.restore_hashes)]
            if restored:
                assert self.secondary is not None
                try:
                    self.secondary.load(list(prefix.restore_hashes), list(restored))
                except BaseException:
                    self.pool.free(reversed(hits + new))
                    raise
                self.pool.cache_blocks(restored, prefix.restore_hashes)
            self._req_blocks[rid] = hits + new
            self._req_num_hashed[rid] = len(hits) + len(restored)
            return True
        blocks = self._req_blocks.get(rid)
        need = -(-(request.num_computed_tokens + num_new_tokens) // bs) - (
            len(blocks) if blocks is not None else 0)
        if need <= 0 and blocks is not None:  # most decode steps: the last block has room
            return True
        if need > self.pool.num_free_blocks:
            return False  # no entry made: a request without one is looked up as new
        if blocks is None:
            blocks = self._req_blocks[rid] = []
            self._req_num_hashed[rid] = 0
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed in the prefix map."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if blocks is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._req_num_hashed.get(rid, 0)
        if num_full <= start:
            return
        self.pool.cache_blocks(blocks[start:num_full], self.block_hashes(request)[start:num_full])
        self._req_num_hashed[rid] = num_full

    def free(self, request: Request, remember_session: bool = False) -> None:
        """Release the request's blocks (tail first). With ``remember_session``, the
        request's computed full blocks become its session's remembered prefix."""
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, None)
        self._req_num_hashed.pop(rid, None)
        if remember_session and request.session_id is not None and self.enable_prefix_caching:
            num_full = request.num_computed_tokens // self.block_size
            self._sessions.set_chain(request.session_id, list(self.block_hashes(request)[:num_full]))
        if blocks:
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    def holds_blocks(self, request_id: str) -> bool:
        return request_id in self._req_blocks

    # ----------------------------------------------------------------- sessions
    def session_block_hashes(self, session_id: str) -> list[int]:
        """Hash chain of the session's last finished request (prompt + output full blocks)."""
        return list(self._sessions.chain(session_id) or [])

    def session_cached_blocks(self, session_id: str) -> int:
        """How many leading blocks of the session's remembered prefix are still cached."""
        return self._sessions.count(session_id)

    def session_block_ids(self, session_id: str) -> list[int]:
        """Device blocks of the session's remembered prefix that are still cached."""
        chain = self._sessions.chain(session_id) or []
        found = self.pool.lookup_all(chain[: self._sessions.count(session_id)])
        return [b for b in found if b is not None]

    def pin_session(self, session_id: str) -> int:
        """Reference the session's cached blocks so they cannot be evicted; returns how
        many. Re-pinning replaces the previous pin."""
        block_ids = self.session_block_ids(session_id)
        self.pool.touch(block_ids)
        self.unpin_session(session_id)
        if block_ids:
            self._pins[session_id] = block_ids
        return len(block_ids)

    def unpin_session(self, session_id: str) -> None:
        block_ids = self._pins.pop(session_id, None)
        if block_ids:
            self.pool.free(reversed(block_ids))

    def forget_session(self, session_id: str) -> None:
        self.unpin_session(session_id)
        self._sessions.drop(session_id)

    @property
    def pinned_sessions(self) -> list[str]:
        return list(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(b) for b in self._pins.values())

    # -------------------------------------------------------------------- reset
    def reset(self, num_blocks: int | None = None) -> None:
        """Drop every device block, pins and session memory included (a model switch), and
        manage ``num_blocks`` blocks from now on (None: as many as before). Requires no
        request to hold blocks."""
        if self._req_blocks:
            raise RuntimeError(
                f"cannot reset the KV cache: {len(self._req_blocks)} requests hold blocks"
            )
        for session_id in list(self._pins):
            self.unpin_session(session_id)
        self._sessions.clear()
        self.pool.reset(num_blocks)

    # -------------------------------------------------------------------- stats
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks
