"""A fixed pool of KV-cache blocks: reference counts, an LRU free queue, a prefix-hash map.

Torch-free: it only hands out block ids; the tensors live in the model runner.

Block lifetimes:
- a block is in the free queue if and only if its reference count is 0;
- ``allocate`` takes blocks from the *front* of the free queue (the least recently freed)
  and gives each a reference; a block taken that still held a prefix hash is evicted
  (its hash leaves the map) at that moment, not before;
- ``free`` drops one reference per block id; a block reaching 0 goes to the *back* of the
  free queue and keeps its hash, so a later request with the same prefix can ``touch`` it
  back (prefix caching) until allocation pressure evicts it;
- ``cache_block`` registers a *referenced* block under the hash of the tokens whose KV it
  holds; the first block registered under a hash wins, a duplicate stays unhashed.

Ids are deterministic: a fresh pool hands out 0, 1, 2, ... in order.

``presence`` (optional) is told each hash that enters or leaves the prefix map (not on
``reset``, whose caller clears it), so it can keep prefix counts without walking chains.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial
from itertools import takewhile
from operator import is_not

from substrate.prefix_presence import PrefixPresence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}
        self._num_free_hashed = 0
        self.presence: PrefixPresence | None = None

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (allocatable; some may still hold a cached prefix)."""
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix (reusable until evicted)."""
        return self._num_free_hashed

    @property
    def num_hashed_blocks(self) -> int:
        """Blocks registered in the prefix map, referenced or not."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def count_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` no request references (free, maybe cached)."""
        return list(map(self._ref.__getitem__, block_ids)).count(0)

    def block_hash(self, block_id: int) -> int | None:
        return self._hash[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding the prefix named by ``block_hash``, if still cached."""
        return self._cached.get(block_hash)

    def lookup_all(self, block_hashes: Iterable[int]) -> list[int | None]:
        """``lookup`` of each hash, in order."""
        return list(map(self._cached.get, block_hashes))

    def lookup_prefix(self, block_hashes: Iterable[int]) -> list[int]:
        """``lookup`` of each hash up to the first not cached (a chain's cached head)."""
        return list(takewhile(partial(is_not, None), map(self._cached.get, block_hashes)))

    def hash_membership(self) -> Callable[[int], bool]:
        """Whether a hash is in the prefix map, as a function that does not keep the pool
        alive (a ``presence`` built on it makes no reference cycle with the pool)."""
        return self._cached.__contains__

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (first is evicted first)."""
        return list(self._free)

    # ------------------------------------------------------------- transitions
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, one reference each."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {num_blocks}, {len(self._free)} free")
        out: list[int] = []
        pop, ref, hashes, evict = self._free.popitem, self._ref, self._hash, self._evict
        for _ in range(num_blocks):
            block_id, _ = pop(last=False)
            if hashes[block_id] is not None:
                evict(block_id)
            ref[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a cache hit, a fork or a pin)."""
        ref, free, hashes = self._ref, self._free, self._hash
        for block_id in block_ids:
            if ref[block_id] == 0:
                del free[block_id]
                if hashes[block_id] is not None:
                    self._num_free_hashed -= 1
            ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in order; blocks reaching 0 join the queue tail."""
        ref, free, hashes = self._ref, self._free, self._hash
        for block_id in block_ids:
            count = ref[block_id] - 1
            if count < 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            ref[block_id] = count
            if count == 0:
                free[block_id] = None
                if hashes[block_id] is not None:
                    self._num_free_hashed += 1

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a referenced, full block under ``block_hash``; False if the hash is taken
        by another block (this one then stays unhashed) or the block already has a hash."""
        self.cache_blocks((block_id,), (block_hash,))
        return self._hash[block_id] == block_hash

    def cache_blocks(self, block_ids: Iterable[int], block_hashes: Iterable[int]) -> None:
        """``cache_block`` for each pair, in order."""
        ref, hashes, cached = self._ref, self._hash, self._cached
        added: list[int] = []
        try:
            for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
                if ref[block_id] <= 0:
                    raise RuntimeError(f"cannot cache KV block {block_id}: it is not referenced")
                if hashes[block_id] is not None or block_hash in cached:
                    continue
                cached[block_hash] = block_id
                hashes[block_id] = block_hash
                added.append(block_hash)
        finally:  # what entered the map is told, even when a later pair was refused
            if self.presence is not None and added:
                self.presence.added_all(added)

    def reset(self, num_blocks: int | None = None) -> None:
        """Forget every cached prefix and restore the initial free order, with ``num_blocks``
        blocks from now on (None: as many as before).

        Requires every block to be free (no running request, no pin): a model switch.
        """
        held = [i for i, r in enumerate(self._ref) if r > 0]
        if held:
            raise RuntimeError(f"cannot reset the block pool: {len(held)} blocks still referenced")
        if num_blocks is not None:
            if num_blocks < 1:
                raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
            self.num_blocks = num_blocks
            self._ref = [0] * num_blocks
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        self._num_free_hashed = 0
        self._free = OrderedDict.fromkeys(range(self.num_blocks))

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is not None:
            self._hash[block_id] = None
            self._num_free_hashed -= 1
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
                if self.presence is not None:
                    self.presence.removed(block_hash)
